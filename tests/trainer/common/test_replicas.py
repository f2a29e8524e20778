"""Agreement between workers: sums over workers, the worker's place, SIGTERM on any worker, the resume step.

The collective itself runs on one process (the default strategy); the other workers' answers are
played by a stand-in for the all-reduce, as a real cluster would give them."""

from __future__ import annotations

import logging

import pytest
import tensorflow as tf

from trainer.common.cluster import ClusterInfo
from trainer.common.replicas import Replicas, ReplicasDisagree, shard_by_data
from trainer.common.runtime import Runtime
from trainer.common.signals import StopRequest

CLUSTER = {"chief": ["a:1"], "worker": ["b:1", "c:1"]}


def runtime(task_type: str = "chief", index: int = 0, cluster: dict | None = CLUSTER) -> Runtime:
    info = ClusterInfo({"cluster": cluster, "task": {"type": task_type, "index": index}}, task_type, index)
    return Runtime(
        strategy=tf.distribute.get_strategy(),
        devices=["/physical_device:CPU:0"],
        replicas=1,
        mixed_precision=False,
        cluster=info if cluster else ClusterInfo(None),
        mode="multi_worker",
    )


class Peers(Replicas):
    """This worker among others whose contributions to each all-reduce are given in turn."""

    def __init__(self, runtime: Runtime, stop: StopRequest, others: list) -> None:
        super().__init__(runtime, stop)
        self.others = list(others)

    def all_sum(self, value):
        other = self.others.pop(0)
        if isinstance(value, list):
            return [a + b for a, b in zip(value, other, strict=True)]
        return value + other


def test_all_sum_on_one_process_returns_the_value():
    replicas = Replicas(runtime(cluster=None), StopRequest())
    assert replicas.all_sum(2.5) == 2.5
    assert replicas.all_sum([1.0, 0.0, 3.0]) == [1.0, 0.0, 3.0]


@pytest.mark.parametrize(
    ("task_type", "index", "cluster", "expected"),
    [
        ("chief", 0, CLUSTER, 0),
        ("worker", 0, CLUSTER, 1),
        ("worker", 1, CLUSTER, 2),
        ("worker", 1, {"worker": ["a:1", "b:1"]}, 1),
    ],
    ids=["chief", "worker-0", "worker-1", "no-chief"],
)
def test_the_chief_comes_first_then_the_workers_by_index(task_type, index, cluster, expected):
    assert Replicas(runtime(task_type, index, cluster), StopRequest()).worker_id() == expected


def test_one_process_stops_on_its_own_sigterm():
    stop = StopRequest()
    replicas = Replicas(runtime(cluster=None), stop)
    assert not replicas.stop_agreed(3)
    stop.trigger()
    assert replicas.stop_agreed(3)


def test_sigterm_on_another_worker_stops_this_one_at_the_same_step(caplog):
    replicas = Peers(runtime(), StopRequest(), others=[0.0, 1.0])
    assert not replicas.stop_agreed(5)
    assert replicas.stop_agreed(6)
    assert "another worker received SIGTERM: checkpointing at step 6 with it" in caplog.text


def test_workers_at_the_same_step_resume_there(caplog):
    caplog.set_level(logging.INFO)
    restored = []
    replicas = Peers(runtime("worker", 0), StopRequest(), others=[[12.0, 0.0, 12.0]])
    assert replicas.agree_on_resume(12, holds=lambda step: True, restore=restored.append) == 12
    assert restored == [] and "all 3 worker(s) resume from the chief's checkpoint at step 12" in caplog.text


def test_a_worker_ahead_goes_back_to_the_oldest_step_that_all_hold(caplog):
    restored = []
    # This chief restored step 12; worker 1's stage-in found only step 8. Nobody misses step 8.
    replicas = Peers(runtime(), StopRequest(), others=[[0.0, 12.0, 8.0], 0.0])
    assert replicas.agree_on_resume(12, holds=lambda step: step == 8, restore=restored.append) == 8
    assert restored == [8]
    assert "every worker resumes from step 8, the newest that all of them hold" in caplog.text


def test_the_worker_at_the_oldest_step_does_not_restore_again():
    restored = []
    replicas = Peers(runtime("worker", 1), StopRequest(), others=[[12.0, 12.0, 0.0], 0.0])
    assert replicas.agree_on_resume(8, holds=lambda step: False, restore=restored.append) == 8
    assert restored == []


@pytest.mark.parametrize(
    ("steps", "missing_elsewhere", "holds"),
    [([12.0, 12.0, 0.0], 0.0, True), ([0.0, 12.0, 8.0], 1.0, True), ([0.0, 12.0, 8.0], 0.0, False)],
    ids=["a-worker-restored-nothing", "another-worker-lacks-it", "this-worker-lacks-it"],
)
def test_without_a_common_checkpoint_every_worker_stops_to_start_again(steps, missing_elsewhere, holds):
    replicas = Peers(runtime(), StopRequest(), others=[steps, missing_elsewhere])
    mine = 12 if steps[2] else 0
    with pytest.raises(
        ReplicasDisagree, match=r"the workers restored different checkpoints \(steps \["
    ) as info:
        replicas.agree_on_resume(mine, holds=lambda step: holds, restore=lambda step: None)
    assert "Every worker stops before training" in str(info.value)


def test_the_input_is_sharded_by_element():
    dataset = shard_by_data(tf.data.Dataset.range(4))
    policy = dataset.options().experimental_distribute.auto_shard_policy
    assert policy == tf.data.experimental.AutoShardPolicy.DATA
    assert list(dataset.as_numpy_iterator()) == [0, 1, 2, 3]
