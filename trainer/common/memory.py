"""The trainer's memory in a pod: the container's limit, and what the input pipeline bounds by it.

A pod's memory limit is its cgroup's; the kernel OOM-kills the container past it. The classifier's
input pipeline (trainer/image_classifier/data.py) sizes tf.data's autotuner by it: on its own it
buffers (prefetch, parallel maps) within a RAM budget of half of ``/proc/meminfo``'s memory, the
node's, not the pod's; :func:`tf_data_ram_budget` gives it a share of the container's limit instead.
The default training order holds no shuffle buffer (a permutation read record by record); a
``--shuffle-buffer N`` holds N images, as asked.

Not done: fixing glibc's mmap threshold. Once a block above its initial threshold (128 KiB) is freed,
glibc raises the threshold, and the images streaming through the pipeline (150 KiB each at 224 px) are
then carved from the threads' heaps, which fragment: one epoch of 11,501 prepared images at 224 px
through the training pipeline peaked at 1,258 to 1,313 MiB, against 1,109 to 1,114 MiB with the
threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``; 565 MiB of either is TensorFlow). But
mapping and unmapping every image cost about twice the time per epoch in paired runs on a loaded
2-core machine (10.3 and 10.8 s against 3.8 to 5.2 s; 4.0 to 10.4 s in a later pair): memory that
the GPU's feed cannot pay for. Trimming the heaps every 0.2 to 1 s (``malloc_trim``) saved 15 to
100 MiB, within the noise of the same runs.
"""

from __future__ import annotations

from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large is no limit.
UNLIMITED = 1 << 60
# The share of the container's limit that tf.data's buffers may take (TensorFlow's own default: half of
# the machine's memory); the rest is TensorFlow, the model, a --shuffle-buffer and the batches in use.
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
