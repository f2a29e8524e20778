"""`make demo`'s run is a run of the Airflow that `make airflow` serves: its DagRun, task instances and
task logs are in that Airflow home's metadata database (the dev stack's Postgres) and log folder, so
the Training page's "Airflow run" link opens it.

The demo runs as `make demo` runs it (``python -m include.demo image_classifier``), with an Airflow
home and a demo folder of the test's own; the run is then read back through the REST API of an
API server on that home, as the UI reads it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest

from include.airflow_ui import AirflowUI
from include.devstack.stack import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
DAG_ID = "train_image_classifier"


def test_the_demos_run_and_its_task_logs_are_in_the_ui_s_database(devstack, tmp_path):
    home = tmp_path / "airflow"
    env = {
        **os.environ,
        "KUBETRAIN_STACK_DIR": str(devstack.state_dir),
        "AIRFLOW_HOME": str(home),
        "KUBETRAIN_DEMO_DIR": str(tmp_path / "demo"),
    }
    proc = subprocess.run(
        [str(PYTHON), "-m", "include.demo", "image_classifier"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    found = re.search(rf"^{DAG_ID} run (\S+): success in", out, re.M)
    assert found, out[-4000:]
    run_id = found[1]
    # the ending: what still runs, where, and how to stop it
    state = devstack.load_state()
    ending = out[out.index("still running") :]
    for address in (state["s3"]["endpoint"], state["registry"], state["kubeapi"]):
        assert address in ending, ending
    assert f"127.0.0.1:{state['ports']['postgres']}" in ending and "make stack-down" in ending

    with AirflowUI(home, devstack.env(), port=free_port()).api_server_only() as ui:
        run = ui.api("GET", f"/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}")
        assert run["state"] == "success"
        tis = ui.task_instances(DAG_ID, run_id)
        ran = {task: ti for task, ti in tis.items() if ti["state"] in ("success", "failed")}
        assert {"stage_dataset", "check_new", "record"} <= set(ran), tis
        for task, ti in ran.items():
            log = ui.api(
                "GET",
                f"/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task}/logs/{ti['try_number']}"
                "?full_content=true",
            )
            events = [m.get("event", "") if isinstance(m, dict) else m for m in log["content"]]
            assert any(f"[DAG TEST] end task task_id={task} " in e for e in events), (task, events[-20:])
            if task == "train":  # trained now, not skipped as trained before (train once): its epochs
                assert any(" epoch 1: " in e for e in events), events[-40:]
