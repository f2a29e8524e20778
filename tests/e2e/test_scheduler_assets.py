"""With a real scheduler: a new dataset version triggers exactly one retraining run, the same bytes none.

Airflow runs as it does for `make airflow` (include/airflow_ui.py: API server, scheduler,
DAG processor and triggerer, LocalExecutor) against the dev stack. watch_datasets watches
only the digits dataset; train_image_classifier is scheduled on that dataset's Asset (its
cron is switched off so that only the Asset can start it).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from include.airflow_ui import AirflowUI
from include.devstack.stack import free_port, s3_client

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
WATCH = "watch_datasets"
TRAIN = "train_image_classifier"
DATASET_URI = "s3://datasets/digits/"
DATASET_KEY = "digits/digits.zip"
STAGE_TASK = "stage_digits"  # watch_datasets names its task after the dataset


def small_digits(out: Path) -> Path:
    """200 real digit images, plus two unreadable files whose bytes come from a fresh seed,
    so that this session's upload is a dataset version no earlier test has staged."""
    subprocess.run(
        [
            str(TRAINER_PYTHON),
            "-m",
            "include.sample_data.digits",
            "--out",
            str(out),
            "--size",
            "16",
            "--per-class",
            "20",
            "--corrupt",
            "2",
            "--seed",
            str(secrets.randbelow(2**31)),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return out


def expected_version(s3, bucket: str, key: str) -> str:
    """The dataset version of a one-object source, computed from the manifest format's definition."""
    head = s3.head_object(Bucket=bucket, Key=key)
    line = f"{bucket}/{key}\t{head['ContentLength']}\t{head['ETag']}"
    return hashlib.sha256(line.encode()).hexdigest()[:16]


def wait_for(predicate, timeout: float, what: str, ui: AirflowUI, interval: float = 2):
    """``predicate()`` once truthy, looking every ``interval`` s until ``timeout``. A look that the API
    server did not answer in time (on a loaded machine its one worker can be busy for a while) is a
    look that saw nothing yet: the deadline, not one slow answer, decides."""
    deadline = time.monotonic() + timeout
    slow = None
    while True:
        ui.check_alive()
        try:
            value = predicate()
        except TimeoutError as exc:
            value, slow = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            late = f"; the API server's last unanswered look: {slow}" if slow else ""
            raise AssertionError(f"{what}: not within {timeout:.0f} s (logs: {ui.home / 'logs'}){late}")
        time.sleep(interval)


def new_runs(ui: AirflowUI, dag_id: str, before: set[str]) -> list[dict]:
    return [r for r in ui.runs(dag_id) if r["dag_run_id"] not in before]


def test_new_dataset_version_triggers_one_training_run_and_the_same_bytes_none(devstack, tmp_path):
    stack_env = devstack.env()
    s3 = s3_client(stack_env)
    archive = small_digits(tmp_path / "digits.zip")
    s3.upload_file(str(archive), "datasets", DATASET_KEY)
    version = expected_version(s3, "datasets", DATASET_KEY)

    ui = AirflowUI(
        tmp_path / "airflow",
        stack_env,
        port=free_port(),
        paused_at_creation=True,
        env={
            "KUBETRAIN_WATCHED_DATASETS": DATASET_URI,
            "KUBETRAIN_IMAGE_CLASSIFIER_CRON": "",
            "KUBETRAIN_IMAGE_BUILD_CRON": "",
            "KUBETRAIN_RETRY_DELAY_SECONDS": "5",
        },
    )
    with ui:
        ui.wait_dags([WATCH, TRAIN])
        train_before = {r["dag_run_id"] for r in ui.runs(TRAIN)}
        watch_before = {r["dag_run_id"] for r in ui.runs(WATCH)}
        ui.set_paused(TRAIN, False)
        # Unpausing lets the scheduler add a run for the latest cron tick next to the manual one;
        # whichever runs first stages the new version, the other finds it staged: one event.
        ui.trigger(WATCH)
        ui.set_paused(WATCH, False)

        runs = wait_for(
            lambda: new_runs(ui, TRAIN, train_before), 240, f"a {TRAIN} run from the Asset event", ui
        )
        assert [r["run_type"] for r in runs] == ["asset_triggered"], runs
        run_id = runs[0]["dag_run_id"]
        events = ui.api("GET", f"/dags/{TRAIN}/dagRuns/{quote(run_id, safe='')}/upstreamAssetEvents")[
            "asset_events"
        ]
        assert [
            (e["name"], e["source_dag_id"], e["source_task_id"], e["extra"].get("version")) for e in events
        ] == [(DATASET_URI, WATCH, STAGE_TASK, version)]
        assert [(d["dag_id"], d["run_id"]) for d in events[0]["created_dagruns"]] == [(TRAIN, run_id)]
        stager = events[0]["source_run_id"]
        assert ui.task_instances(WATCH, stager)[STAGE_TASK]["state"] == "success"
        manifest = json.loads(
            s3.get_object(Bucket="training", Key=f"manifests/digits/{version}.json")["Body"].read()
        )
        assert (manifest["kind"], manifest["version"], manifest["source"]) == (
            "kubetrain/dataset-manifest",
            version,
            DATASET_URI,
        )
        asset_id = events[0]["asset_id"]

        # The retraining run stages the same snapshot and gets past the dedupe check into training.
        def training_started() -> bool:
            tis = ui.task_instances(TRAIN, run_id)
            failed = {k: ui.task_errors(TRAIN, run_id, k) for k, v in tis.items() if v["state"] == "failed"}
            assert not failed, f"the asset-triggered run failed: {failed} (logs: {ui.home / 'logs'})"
            return tis["train"]["state"] in ("running", "deferred", "success")

        wait_for(training_started, 180, f"{TRAIN} run {run_id} reaching its train task", ui)
        staged = ui.api(
            "GET",
            f"/dags/{TRAIN}/dagRuns/{quote(run_id, safe='')}/taskInstances/stage_dataset/xcomEntries/return_value",
        )
        staged_value = staged["value"] if isinstance(staged["value"], dict) else json.loads(staged["value"])
        assert staged_value["version"] == version
        assert staged_value["manifest_uri"] == f"s3://training/manifests/digits/{version}.json"
        events_before = ui.api("GET", f"/assets/events?asset_id={asset_id}&limit=100")["total_entries"]

        # The same bytes uploaded again: same size and ETag, so the same version; nothing to do.
        s3.upload_file(str(archive), "datasets", DATASET_KEY)
        assert expected_version(s3, "datasets", DATASET_KEY) == version
        again = ui.trigger(WATCH)
        ui.wait_run(WATCH, again, timeout=180)
        assert ui.task_instances(WATCH, again)[STAGE_TASK]["state"] == "skipped"

        # No second, wrong, run: once every look at the data has ended, whatever Asset event they emitted
        # is queued for the scheduler or already made a run, and the scheduler empties the queue in the
        # transaction that creates the run, so an empty queue means every run it made is listed.
        def settled() -> bool:
            watches = new_runs(ui, WATCH, watch_before)
            ended = all(r["state"] in ("success", "failed") for r in watches)
            return ended and ui.api("GET", f"/dags/{TRAIN}/assets/queuedEvents")["total_entries"] == 0

        wait_for(settled, 180, f"every {WATCH} run ended and no Asset event queued for {TRAIN}", ui)
        assert [r["dag_run_id"] for r in new_runs(ui, TRAIN, train_before)] == [run_id]
        # Every other finished look at the data (this one, and the first one that did not stage) skipped.
        later = [
            r
            for r in new_runs(ui, WATCH, watch_before)
            if r["dag_run_id"] != stager and r["state"] in ("success", "failed")
        ]
        assert again in [r["dag_run_id"] for r in later]
        assert [
            (r["state"], ui.task_instances(WATCH, r["dag_run_id"])[STAGE_TASK]["state"]) for r in later
        ] == [("success", "skipped")] * len(later)
        assert (
            ui.api("GET", f"/assets/events?asset_id={asset_id}&limit=100")["total_entries"] == events_before
        )

        # Whatever the retraining run has left to do, it finishes by itself. The bound is for a hung run,
        # not a speed expectation: on a loaded machine each LocalExecutor task process takes tens of
        # seconds to start, and four tasks may be left after training started.
        final = ui.wait_run(TRAIN, run_id, timeout=900)
        tis = {k: v["state"] for k, v in ui.task_instances(TRAIN, run_id).items()}
        errors = {k: ui.task_errors(TRAIN, run_id, k) for k, state in tis.items() if state == "failed"}
        assert final["state"] == "success", (
            f"{TRAIN} run {run_id} ended {final['state']}: {tis}; errors: {errors}"
        )
