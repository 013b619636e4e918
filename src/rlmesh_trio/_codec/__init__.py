"""The rlmesh-wire-v1 value codec: spaces, values, metadata, conformance checks.

Pure functions and plain objects: no threads, no I/O. Safe to call from any thread;
a :class:`SpaceCodec` is immutable after construction and shared by all lanes.
"""

from ._conformance import Candidate as Candidate
from ._meta import from_meta_map as from_meta_map
from ._meta import from_meta_value as from_meta_value
from ._meta import to_meta_map as to_meta_map
from ._meta import to_meta_value as to_meta_value
from ._spaces import SpaceCodec as SpaceCodec
from ._spaces import space_to_spec as space_to_spec
from ._spaces import spec_to_space as spec_to_space

__all__ = [
    "Candidate",
    "SpaceCodec",
    "from_meta_map",
    "from_meta_value",
    "space_to_spec",
    "spec_to_space",
    "to_meta_map",
    "to_meta_value",
]
