"""The pod side's TF_CONFIG rule (trainer/common/cluster.py), against the table the Airflow side is tested on,
and the choice of distribution mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.common import cluster

REPO = Path(__file__).resolve().parents[3]
CASES = json.loads((REPO / "tests" / "plugins" / "distributed" / "tf_config_cases.json").read_text())["cases"]
# The same patterns as plugins/kubetrain/distributed/cluster.py host_pattern (checked there against the table).
PATTERNS = {
    "indexed_job": "{job}-{{role}}-{{index}}.{job}:2222",
    "trainjob": "{job}-{{role}}-0-{{index}}.{job}:2222",
    "tfjob": "{job}-{{role}}-{{index}}.{namespace}.svc:2222",
}


def env_of(case: dict) -> dict[str, str]:
    hosts = case["hosts"] if case["backend"] is None else PATTERNS[case["backend"]].format(**case)
    env = {
        cluster.REPLICAS_ENV: json.dumps(case["replicas"]),
        cluster.HOSTS_ENV: hosts,
        cluster.INDEX_ENV: str(case["index"]),
    }
    if case["role"]:
        env[cluster.ROLE_ENV] = case["role"]
    return env


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_computed_tf_config_matches_the_table(case):
    assert cluster.tf_config(env_of(case)) == case["tf_config"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_an_engines_tf_config_is_used_as_is(case):
    # TFJob sets TF_CONFIG: the replica takes it whatever else the environment holds.
    env = {"TF_CONFIG": json.dumps(case["tf_config"]), cluster.REPLICAS_ENV: '{"worker": 9}'}
    info = cluster.ClusterInfo.from_environ(env)
    assert info.config == case["tf_config"]
    assert info.is_chief == (
        case["tf_config"]["task"]["type"] == "chief"
        or (
            "chief" not in case["tf_config"]["cluster"]
            and case["tf_config"]["task"] == {"type": "worker", "index": 0}
        )
    )


@pytest.mark.parametrize(
    ("replicas", "strategy", "mode"),
    [
        (None, "auto", "mirrored"),
        ({"chief": 1}, "auto", "mirrored"),
        ({"chief": 1, "worker": 1}, "auto", "multi_worker"),
        ({"chief": 1, "worker": 2, "ps": 1}, "auto", "parameter_server"),
        ({"chief": 1, "worker": 1}, "multi_worker", "multi_worker"),
        ({"chief": 1, "worker": 2, "ps": 1}, "parameter_server", "parameter_server"),
    ],
)
def test_auto_picks_the_mode_the_cluster_implies(replicas, strategy, mode):
    env = (
        {}
        if replicas is None
        else {
            cluster.REPLICAS_ENV: json.dumps(replicas),
            cluster.HOSTS_ENV: "h-{replica}:1",
            cluster.INDEX_ENV: "0",
        }
    )
    assert cluster.placement(strategy, env)[1] == mode


@pytest.mark.parametrize(
    ("env", "strategy", "message"),
    [
        (
            {
                cluster.REPLICAS_ENV: '{"chief": 1, "worker": 1}',
                cluster.HOSTS_ENV: "h-{replica}:1",
                cluster.INDEX_ENV: "0",
            },
            "mirrored",
            "--strategy mirrored trains on one pod's devices, but TF_CONFIG names several workers",
        ),
        ({}, "parameter_server", "--strategy parameter_server needs a cluster with a chief"),
        (
            {
                cluster.REPLICAS_ENV: '{"chief": 1, "worker": 1, "ps": 1}',
                cluster.HOSTS_ENV: "h-{replica}:1",
                cluster.INDEX_ENV: "0",
            },
            "multi_worker",
            "cannot run in a cluster with parameter servers",
        ),
        (
            {cluster.REPLICAS_ENV: '{"worker": 2}', cluster.HOSTS_ENV: "h-{replica}:1"},
            "auto",
            "JOB_COMPLETION_INDEX=None is not a replica index",
        ),
        (
            {
                cluster.REPLICAS_ENV: '{"worker": 2}',
                cluster.HOSTS_ENV: "h-{replica}:1",
                cluster.INDEX_ENV: "2",
            },
            "auto",
            "JOB_COMPLETION_INDEX=2 is outside the job's 2 replica(s)",
        ),
        (
            {cluster.REPLICAS_ENV: '{"boss": 1}', cluster.HOSTS_ENV: "h:1", cluster.INDEX_ENV: "0"},
            "auto",
            "unknown role 'boss'",
        ),
        (
            {cluster.REPLICAS_ENV: '{"worker": 2}', cluster.HOSTS_ENV: "h-{node}:1", cluster.INDEX_ENV: "0"},
            "auto",
            "is not a host pattern",
        ),
        (
            {cluster.REPLICAS_ENV: '{"worker": 2}', cluster.INDEX_ENV: "0"},
            "auto",
            "KUBETRAIN_TF_HOSTS is not",
        ),
    ],
)
def test_inconsistent_clusters_are_refused_with_the_variable_named(env, strategy, message):
    with pytest.raises(cluster.ClusterConfigError) as err:
        cluster.placement(strategy, env)
    assert message in str(err.value)


def test_the_chief_is_the_chief_else_worker_0_and_ps_replicas_only_serve():
    base = {cluster.HOSTS_ENV: "h-{replica}:1"}
    mwms = {**base, cluster.REPLICAS_ENV: '{"chief": 1, "worker": 1}'}
    ps = {**base, cluster.REPLICAS_ENV: '{"chief": 1, "worker": 2, "ps": 1}'}
    assert cluster.ClusterInfo.from_environ({**mwms, cluster.INDEX_ENV: "0"}).is_chief
    assert not cluster.ClusterInfo.from_environ({**mwms, cluster.INDEX_ENV: "1"}).is_chief
    assert cluster.ClusterInfo.from_environ({**mwms, cluster.INDEX_ENV: "1"}).workers == 2
    info, mode = cluster.placement("auto", {**ps, cluster.INDEX_ENV: "3"})
    assert (info.task_type, info.workers, info.parameter_servers) == ("ps", 2, 1)
    assert cluster.serves_only(info, mode)
    info, mode = cluster.placement("auto", {**ps, cluster.INDEX_ENV: "0"})
    assert info.is_chief and not cluster.serves_only(info, mode)
