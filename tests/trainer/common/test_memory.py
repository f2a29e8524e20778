"""The container's memory limit as the trainer reads it, and what the input pipeline bounds by it."""

from __future__ import annotations

import pytest

from trainer.common.memory import container_memory_limit, tf_data_ram_budget


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
