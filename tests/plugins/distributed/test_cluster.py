"""The Airflow side's TF_CONFIG rule and host names, against the table the pod side is tested on too."""

from __future__ import annotations

import json
from pathlib import Path

import airflow  # noqa: F401  (puts the plugins folder on sys.path)
import pytest

from kubetrain.distributed import cluster

CASES = json.loads((Path(__file__).with_name("tf_config_cases.json")).read_text())["cases"]


def hosts_of(case: dict) -> str:
    if case["backend"] is None:
        return case["hosts"]
    return cluster.host_pattern(case["backend"], job=case["job"], namespace=case["namespace"])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_rule_gives_the_tables_tf_config(case):
    assert (
        cluster.tf_config(case["replicas"], hosts_of(case), case["index"], case["role"]) == case["tf_config"]
    )


@pytest.mark.parametrize(
    "case", [c for c in CASES if c["backend"] not in (None, "tfjob")], ids=lambda c: c["name"]
)
def test_the_replica_env_carries_what_the_pod_side_needs(case):
    env = cluster.replica_env(case["replicas"], hosts_of(case), case["role"])
    assert json.loads(env[cluster.REPLICAS_ENV]) == case["replicas"]
    assert env[cluster.HOSTS_ENV] == hosts_of(case) and env[cluster.ROLE_ENV] == case["role"]


def test_unknown_backend_and_index_out_of_range_are_named():
    with pytest.raises(ValueError, match="backend 'mpijob' is not one of tfjob, trainjob, indexed_job"):
        cluster.host_pattern("mpijob", job="j", namespace="n")
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX=2 is outside the 2 worker"):
        cluster.task_of({"worker": 2}, 2, "worker")
