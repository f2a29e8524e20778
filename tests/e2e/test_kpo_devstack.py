"""The provider's pod and job operators against the dev stack's local Kubernetes API, via `airflow dags test`.

Each DAG in tests/e2e/dags runs in a subprocess with a private Airflow home (a copy of the
migrated metadata DB), the dev stack's environment, and the DAGs folder pointing at
tests/e2e/dags. Outcomes are read back from the task log, the metadata DB and the API.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from kubernetes import client, config

from include.devstack.stack import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
AIRFLOW = REPO / ".venv" / "bin" / "airflow"
DAGS = Path(__file__).parent / "dags"
SHARED_HOME = REPO / ".airflow"


@pytest.fixture(scope="module")
def airflow_env(devstack, tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("airflow-home")
    db = home / "airflow.db"
    env = {
        **os.environ,
        **devstack.env(),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{db}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        # The env file exports KUBECONFIG and also names it in the connection (kube_config_path); the
        # deferrable operator turns KUBECONFIG into config_dict and then refuses both at once. The
        # connection without the path uses KUBECONFIG in both modes.
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": json.dumps(
            {"conn_type": "kubernetes", "extra": {"namespace": "kubetrain"}}
        ),
    }
    shared_db = SHARED_HOME / "airflow.db"
    if (SHARED_HOME / ".migrated").exists() and shared_db.exists():
        # sqlite's backup API copies a consistent snapshot even while another process writes to it
        with sqlite3.connect(shared_db) as src, sqlite3.connect(db) as dst:
            src.backup(dst)
    else:
        subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    return env


def run_dag(env: dict[str, str], dag_id: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(AIRFLOW), "dags", "test", dag_id],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def task_states(env: dict[str, str], dag_id: str) -> dict[str, str]:
    with sqlite3.connect(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].removeprefix("sqlite:///")) as db:
        run_id = db.execute(
            "select run_id from dag_run where dag_id = ? order by id desc limit 1", (dag_id,)
        ).fetchone()[0]
        rows = db.execute(
            "select task_id, state from task_instance where dag_id = ? and run_id = ?", (dag_id, run_id)
        )
        return dict(rows.fetchall())


def xcom(env: dict[str, str], dag_id: str, task_id: str, key: str = "return_value"):
    with sqlite3.connect(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].removeprefix("sqlite:///")) as db:
        row = db.execute(
            "select value from xcom where dag_id = ? and task_id = ? and key = ? order by timestamp desc limit 1",
            (dag_id, task_id, key),
        ).fetchone()
    assert row is not None, f"no XCom {key} for {dag_id}.{task_id}"
    return json.loads(row[0])


def core_api(env: dict[str, str]) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(env["KUBETRAIN_ADMIN_KUBECONFIG"]))


def test_pod_and_job_operators(airflow_env):
    proc = run_dag(airflow_env, "kpo_devstack_pod")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert task_states(airflow_env, "kpo_devstack_pod") == {
        "sync_pod": "success",
        "deferrable_pod": "success",
        "indexed_job": "success",
    }
    fingerprint = hashlib.sha256(airflow_env["KUBETRAIN_S3_ACCESS_KEY_ID"].encode()).hexdigest()[:12]
    for task_id in ("sync_pod", "deferrable_pod"):
        value = xcom(airflow_env, "kpo_devstack_pod", task_id)
        # init container output in the shared emptyDir, a live native sidecar, the Secret-sourced
        # env var, and PID 1 inside the container's own PID namespace
        assert value["greeting"] == "hello-from-init"
        assert value["beats"] >= 1
        assert value["fingerprint"] == fingerprint
        assert value["pid"] == 1
    # streamed container logs reached the task log, in order; the Secret value itself never did
    for line in ("greeting from init: hello-from-init", f"key fingerprint: {fingerprint}", "progress 3/3"):
        assert f"[base] {line}" in out
        assert f"[base] logs: {line}" in out  # the deferrable task's logs, fetched on re-entry
    assert out.index("[base] progress 1/3") < out.index("[base] progress 3/3")
    assert airflow_env["KUBETRAIN_S3_ACCESS_KEY_ID"] not in out
    assert "Unexpected error while waiting for pod" not in out  # the trigger itself succeeded
    assert "Trigger completed" in out
    # the job ran both indexes, each in its own pod with the index's hostname
    assert "job index=0 host=" in out and "job index=1 host=" in out
    job = xcom(airflow_env, "kpo_devstack_pod", "indexed_job", "job")
    assert job["status"]["succeeded"] == 2
    assert job["status"]["completed_indexes"] == "0-1"
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in job["status"]["conditions"])
    # on_finish_action=delete_pod: no pod of this DAG is left
    pods = (
        core_api(airflow_env).list_namespaced_pod("kubetrain", label_selector="dag_id=kpo_devstack_pod").items
    )
    assert [p.metadata.name for p in pods] == []


def test_failing_pod_fails_the_task_with_its_exit_code(airflow_env):
    proc = run_dag(airflow_env, "kpo_devstack_failure")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert task_states(airflow_env, "kpo_devstack_failure") == {"failing_pod": "failed"}
    assert "returned a failure" in out
    assert "'exit_code': 3" in out
    assert "'reason': 'Error'" in out
    assert "[base] about to fail" in out
    pods = (
        core_api(airflow_env)
        .list_namespaced_pod("kubetrain", label_selector="dag_id=kpo_devstack_failure")
        .items
    )
    assert [p.metadata.name for p in pods] == []
