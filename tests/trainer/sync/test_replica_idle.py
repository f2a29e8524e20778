"""Only the chief's checkpoint-sync sidecar syncs when every replica's pod has one (one pod template)."""

from __future__ import annotations

import pytest

from kubetrain_contract.cluster import ClusterError
from trainer.sync.replica import idle_reason


@pytest.mark.parametrize(
    ("environ", "idle"),
    [
        ({}, None),  # a single-pod run
        ({"KUBETRAIN_TF_REPLICAS": '{"chief": 1, "worker": 2}', "JOB_COMPLETION_INDEX": "0"}, None),
        (
            {"KUBETRAIN_TF_REPLICAS": '{"chief": 1, "worker": 2}', "JOB_COMPLETION_INDEX": "2"},
            "replica worker 1 is not the chief",
        ),
        ({"KUBETRAIN_TF_REPLICAS": '{"worker": 2}', "JOB_COMPLETION_INDEX": "0"}, None),  # worker 0 leads
        ({"KUBETRAIN_TF_REPLICAS": '{"worker": 2}', "JOB_COMPLETION_INDEX": "1"}, "replica worker 1"),
        (
            {
                "KUBETRAIN_TF_REPLICAS": '{"chief": 1, "worker": 2}',
                "KUBETRAIN_TF_ROLE": "chief",
                "JOB_COMPLETION_INDEX": "0",
            },
            None,
        ),
    ],
)
def test_the_chief_syncs_and_the_others_idle(environ, idle):
    reason = idle_reason(environ)
    assert (reason is None) == (idle is None)
    if idle:
        assert reason.startswith(idle)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"KUBETRAIN_TF_REPLICAS": '{"chief": 1}', "JOB_COMPLETION_INDEX": "x"}, "JOB_COMPLETION_INDEX='x'"),
        ({"KUBETRAIN_TF_REPLICAS": '{"chief": 1}', "JOB_COMPLETION_INDEX": "3"}, "outside"),
        ({"KUBETRAIN_TF_REPLICAS": "[]", "JOB_COMPLETION_INDEX": "0"}, "is not a JSON object"),
    ],
)
def test_bad_replica_values_are_named(environ, message):
    with pytest.raises(ClusterError, match=message):
        idle_reason(environ)
