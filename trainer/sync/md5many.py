"""The MD5 of many buffers at once, side by side in a vector register's lanes.

The work is done by ``_md5many.so``, built from ``native/md5many.c`` next to this module (the
sync image's build compiles it; ``make setup`` does for a checkout). Where it is absent, or the
CPU has neither AVX-512 nor AVX2, or it disagrees with hashlib on the test vectors checked when
it first loads, each buffer is hashed by hashlib, one after the other: the results are the same,
only slower. The call lets go of the GIL, as hashlib does.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path

LIBRARY = Path(__file__).with_name("_md5many.so")
# lengths around MD5's block (64 bytes) and padding (56) boundaries, more buffers than lanes:
# checked against hashlib when the library first loads
_PROBE = [
    (bytes(range(251)) * 24)[i : i + n]
    for i, n in enumerate(
        [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 1000, 1023, 1024, 1025, 5000]
    )
]


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, int, str]:
    """The library, its lanes on this CPU (0: none) and why it is not used, if it is not."""
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError as exc:
        return None, 0, f"{LIBRARY.name} not loaded ({exc})"
    lib.kt_md5_lanes.argtypes = []
    lib.kt_md5_lanes.restype = ctypes.c_int
    lib.kt_md5_many.argtypes = [
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_char_p),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    lib.kt_md5_many.restype = ctypes.c_int
    lanes = lib.kt_md5_lanes()
    if not lanes:
        return lib, 0, "this CPU has neither AVX-512 nor AVX2"
    for width in (lanes, 8) if lanes == 16 else (lanes,):
        if _call(lib, _PROBE, width) != [hashlib.md5(b).digest() for b in _PROBE]:
            return lib, 0, f"{LIBRARY.name} disagrees with hashlib on this CPU ({width} lanes)"
    return lib, lanes, ""


def _call(lib: ctypes.CDLL, buffers: Sequence[bytes], lanes: int) -> list[bytes] | None:
    n = len(buffers)
    out = ctypes.create_string_buffer(16 * n)
    if lib.kt_md5_many(
        n, (ctypes.c_char_p * n)(*buffers), (ctypes.c_size_t * n)(*map(len, buffers)), out, lanes
    ):
        return None
    raw = out.raw
    return [raw[i : i + 16] for i in range(0, 16 * n, 16)]


def lanes() -> int:
    """Buffers hashed side by side on this machine: 16 (AVX-512), 8 (AVX2), or 0 (hashlib's MD5)."""
    return _library()[1]


def unavailable() -> str:
    """Why the buffers are hashed one by one here ("" when they are not)."""
    return _library()[2]


def md5_many(buffers: Sequence[bytes], *, width: int | None = None) -> list[bytes]:
    """The MD5 digest (16 bytes) of each buffer, in order.

    Args:
        buffers: ``bytes`` objects (read in place, not copied).
        width: lanes to use (16 or 8, at most ``lanes()``); by default all this CPU has.
    """
    lib, have, _ = _library()
    width = have if width is None else width
    if width > have:
        raise ValueError(f"width {width}: this machine hashes at most {have} buffers side by side")
    if lib is None or not width or len(buffers) < 2:
        return [hashlib.md5(b).digest() for b in buffers]
    digests = _call(lib, buffers, width)
    if digests is None:  # out of memory for the job list: one by one
        return [hashlib.md5(b).digest() for b in buffers]
    return digests
