"""PNG encoding of a rendered frame (SPEC §7.10).

The reference answers ``render`` with the env's RGB array as an 8-bit RGB PNG, and the
0.1.0 clients decode it back to an ``HxWx3`` array. So every frame we accept is sent as
8-bit RGB: an RGBA frame loses its alpha channel, a gray frame (``HxW`` or ``HxWx1``) is
replicated into three equal channels. Pure function, safe on any thread (runs on the
lane thread, where its time counts as ``encode_ns``).
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


def encode_png(frame: Any) -> bytes:
    """Encode one frame as an 8-bit RGB PNG and return the file's bytes.

    Accepted: an ``HxWx3`` (RGB) or ``HxWx4`` (RGBA, alpha dropped) array, or a gray
    ``HxW`` / ``HxWx1`` array, of dtype ``uint8`` or ``bool`` (``True`` = 255), or of
    another integer dtype whose values all lie in ``[0, 255]``. Anything else (float
    frames, other shapes, an empty frame) raises ``ValueError``; an object numpy cannot
    turn into an array of numbers raises ``TypeError``.
    """
    array = np.asarray(frame)
    rgb = _as_rgb_uint8(array)
    height, width = rgb.shape[0], rgb.shape[1]
    image = Image.frombuffer("RGB", (width, height), rgb.tobytes(), "raw", "RGB", 0, 1)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def _as_rgb_uint8(array: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    if array.dtype.kind not in "biu":
        if array.dtype.kind in "OUSV":
            raise TypeError(f"render frame must be a numeric array, got dtype {array.dtype}")
        raise ValueError(
            f"render frame must have an integer dtype (uint8 RGB), got dtype {array.dtype}"
        )
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        array = np.repeat(array[:, :, np.newaxis], 3, axis=2)
    elif array.ndim == 3 and array.shape[2] == 4:
        array = array[:, :, :3]
    elif not (array.ndim == 3 and array.shape[2] == 3):
        raise ValueError(
            "render frame must be an HxWx3 RGB, HxWx4 RGBA or HxW gray array, "
            f"got shape {array.shape}"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"render frame is empty (shape {array.shape})")
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if array.dtype.kind == "b":
        return np.ascontiguousarray(array.astype(np.uint8) * np.uint8(255))
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > 255:
        raise ValueError(
            f"render frame of dtype {array.dtype} has values outside [0, 255] "
            f"(min {low}, max {high})"
        )
    return np.ascontiguousarray(array.astype(np.uint8))
