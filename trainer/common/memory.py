"""The trainer's memory in a pod: the container's limit, and the allocator settings that keep under it.

A pod's memory limit is its cgroup's; the kernel OOM-kills the container past it. Two things in the
trainer's process do not see it on their own:

* tf.data's autotuner sizes its buffers (prefetch, parallel maps) within a RAM budget of half of
  ``/proc/meminfo``'s memory: the node's, not the pod's. :func:`tf_data_ram_budget` gives it a share
  of the container's limit instead.
* glibc's malloc keeps freed blocks in its heaps for reuse. Once a block larger than its initial
  ``mmap`` threshold (128 KiB) is freed, it raises the threshold to that size, so the images that
  stream through the input pipeline (150 KiB each at 224 px, more at larger sizes) are then carved
  from the heaps of the threads that touch them and stay there, fragmented, after the tensors are
  gone. Measured (one epoch of 11,501 prepared images at 224 px through the classifier's training
  pipeline, batch 64): the process peaked at 1,313 MiB with the dynamic threshold and at 1,037 MiB
  with it fixed at 64 KiB (565 MiB of which is TensorFlow imported), the same figures with tf.data's
  RAM budget at 128 MiB (1,258 MiB) showing the heap, not tf.data's buffers, to be the difference.
  :func:`fix_mmap_threshold` fixes it: each image-sized block is then mapped and returned to the
  kernel as it is freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from pathlib import Path

log = logging.getLogger("kubetrain.trainer")

CGROUP = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large is no limit.
UNLIMITED = 1 << 60
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 64 * 1024
# The share of the container's limit that tf.data's buffers may take (TensorFlow's own default: half of
# the machine's memory); the rest is TensorFlow, the model, the shuffle buffer and the batches in use.
TF_DATA_SHARE = 0.25


def container_memory_limit(root: Path = CGROUP) -> int | None:
    """The memory limit of this process's cgroup in bytes (cgroup v2 or v1); ``None`` where there is none."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (root / name).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return value if 0 < value < UNLIMITED else None
    return None


def tf_data_ram_budget(limit: int | None = None) -> int | None:
    """Bytes tf.data's autotuner may buffer: a share of the container's limit; ``None`` without one."""
    limit = container_memory_limit() if limit is None else limit
    return None if limit is None else int(limit * TF_DATA_SHARE)


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (see the module's text); False where there
    is no glibc (musl, macOS), which leaves the allocator as it is."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
