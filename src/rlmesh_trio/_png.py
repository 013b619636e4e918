"""PNG encoding of a rendered frame (SPEC §7.10).

As the reference encodes it (compared frame by frame with rlmesh 0.1.0): an ``HxWx3``
frame is an 8-bit RGB PNG, ``HxWx4`` an RGBA one and ``HxW`` a gray one (rlmesh's client
decodes each back to the same shape); any other shape (``HxWx1``, two or five channels,
a stack of frames) is no frame (an empty render reply). A frame of another dtype is cast
to ``uint8`` as numpy casts (floats truncated, integers wrapped, ``True`` is 1). Pure
function, safe on any thread (runs on the lane thread, where its time counts as
``encode_ns``).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

PNG_COMPRESS_LEVEL = 1
"""zlib level for frames: the fastest one. Render frames are encoded on every render
request, so speed matters more than size; the reference also writes its PNG stream with
zlib's "fastest" flag (its header is ``78 01``)."""


_COLOR_MODES = {3: "RGB", 4: "RGBA"}
"""PNG mode of an ``HxWxC`` frame by its channels."""


def encode_png(frame: Any) -> bytes | None:
    """Encode one frame as an 8-bit PNG and return the file's bytes, or None for a
    frame of no shape a PNG of the reference holds (see the module's docstring).

    An empty frame raises ``RuntimeError``, one numpy cannot cast to ``uint8`` numpy's
    error (``ValueError`` for text), with the reference's texts.
    """
    array = np.asarray(frame)
    if array.dtype != np.uint8:  # the reference's cast, and its errors
        with np.errstate(invalid="ignore", over="ignore"):
            array = array.astype(np.uint8)
    if array.ndim == 2:
        mode = "L"
    elif array.ndim == 3 and array.shape[2] in _COLOR_MODES:
        mode = _COLOR_MODES[array.shape[2]]
    else:
        return None
    if array.shape[1] == 0:
        raise RuntimeError("Zero width not allowed")
    if array.shape[0] == 0:
        raise RuntimeError("Zero height not allowed")
    height, width = array.shape[0], array.shape[1]
    data = np.ascontiguousarray(array).tobytes()
    image = Image.frombuffer(mode, (width, height), data, "raw", mode, 0, 1)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()
