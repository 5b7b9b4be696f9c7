"""One .npy member (numpy's format, as a shard or token-store tar holds it) back to an array, safely
from several threads at once.

numpy's reader parses the header with `ast.literal_eval`, and CPython 3.11's AST constructor is not
safe when threads build trees at the same moment: the fresh-clone suite once got "SystemError: AST
constructor recursion depth mismatch" from a shard decoded while other threads decoded theirs (the
quality bench decodes shards in a thread pool; CPython gh-106905, fixed in later releases). So the
header (a few dozen bytes) is parsed under one lock with numpy's own public header readers; the data
is copied out of the bytes outside it. Like numpy's loader with allow_pickle=False, an object dtype
(which only pickle could restore) is refused.
"""

from __future__ import annotations

import io
import math
import threading

import numpy as np
from numpy.lib import format as npy_format

_HEADER_LOCK = threading.Lock()
_HEADER_READERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


def npy_from_bytes(data: bytes) -> np.ndarray:
    """A writable array equal to `numpy.lib.format.read_array(io.BytesIO(data))` (allow_pickle=False)."""
    stream = io.BytesIO(data)
    version = npy_format.read_magic(stream)
    reader = _HEADER_READERS.get(version)
    if reader is None:
        raise ValueError(f"npy format version {version}: this reader knows {sorted(_HEADER_READERS)}")
    with _HEADER_LOCK:
        shape, fortran_order, dtype = reader(stream)
    if dtype.hasobject:
        raise ValueError(f"npy array of dtype {dtype} holds Python objects: refused (it would need unpickling)")
    count = math.prod(shape)
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    if fortran_order:
        return flat.reshape(shape[::-1]).transpose().copy()
    return flat.reshape(shape).copy()
