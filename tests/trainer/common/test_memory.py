"""The container's memory limit as the trainer reads it, and the allocator setting it makes at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.common.memory import container_memory_limit, tf_data_ram_budget

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"memory.max": "1610612736\n"}, 1610612736),  # cgroup v2, a pod's 1.5Gi
        ({"memory.max": "max\n"}, None),  # v2, no limit
        ({"memory/memory.limit_in_bytes": "1073741824\n"}, 1 << 30),  # cgroup v1
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1 writes no limit so
        ({}, None),  # no cgroup file system at all
    ],
)
def test_the_limit_is_read_from_cgroup_v2_or_v1(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert container_memory_limit(tmp_path) == expected


def test_tf_data_gets_a_quarter_of_the_limit():
    assert tf_data_ram_budget(1 << 32) == 1 << 30


def test_the_pipeline_bounds_tf_data_by_the_limit(monkeypatch):
    """With a limit, both datasets carry the RAM budget; without one, TensorFlow's default (0: its own)."""
    from trainer.image_classifier import data

    monkeypatch.setattr(data, "tf_data_ram_budget", lambda: 384 << 20)
    pipeline = object.__new__(data.ImagePipeline)
    import tensorflow as tf

    pipeline.tf = tf
    bounded = pipeline._bounded(tf.data.Dataset.range(3))
    assert bounded.options().autotune.ram_budget == 384 << 20
    monkeypatch.setattr(data, "tf_data_ram_budget", lambda: None)
    assert not pipeline._bounded(tf.data.Dataset.range(3)).options().autotune.ram_budget


def test_image_sized_blocks_go_back_to_the_kernel_once_the_threshold_is_fixed():
    """Freed 150 KiB blocks (a 224 px image) stay in glibc's heap after the dynamic threshold rose, and go
    back to the kernel with the threshold fixed: the resident size after freeing 2,000 of them, in a fresh
    process each way."""
    script = (
        "import sys\n"
        "from trainer.common.memory import fix_mmap_threshold\n"
        "if sys.argv[1] == 'fixed': assert fix_mmap_threshold()\n"
        "big = bytearray(1 << 20); del big  # a freed large block raises glibc's dynamic threshold\n"
        "blocks = [b'x' * (150 * 1024 + i) for i in range(2000)]\n"
        "keep = blocks[::50]; del blocks  # a few survivors pin the heap's top, as live tensors do\n"
        "rss = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS:'))\n"
        "print(rss // 1024)\n"
    )

    def resident(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", script, mode], capture_output=True, text=True, check=True, cwd=REPO
        )
        return int(out.stdout)

    dynamic, fixed = resident("dynamic"), resident("fixed")
    assert dynamic > 200 and fixed < 100, (dynamic, fixed)  # MiB: 2,000 x 150 KiB is 293 MiB
