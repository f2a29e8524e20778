"""Sweeps end to end through `airflow dags test` against the dev stack: real pods, real TensorFlow.

One grid sweep of the digits classifier carries most scenarios (4 batch sizes, a killed trial
that resumes, the dataset's prepared copy reused by every later pod, the best trial promoted, the re-run that starts no pod, then median stopping of
a learning rate of 1e-6 next to the trials already trained); a sweep
of a third-party container (a plain Python script) covers tpe's two rounds and the
``--name=value`` hyperparameters; invalid spaces are refused before any pod.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from kubernetes import client, config

from include.devstack import mirror
from include.devstack.stack import NAMESPACE, s3_client
from kubetrain.s3_layout import S3Layout, prepared_uri_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
FAST = {"KUBETRAIN_RETRY_DELAY_SECONDS": "1"}
DAG_ID = "sweep_image_classifier"
CUSTOM_DAG_ID = "sweep_custom_script"
DIGITS = 1797  # the generator's images (scikit-learn's digits)


@pytest.fixture(scope="module")
def s3(devstack):
    env = devstack.env()
    return s3_client(env)


@pytest.fixture(scope="module")
def core(devstack) -> client.CoreV1Api:
    return client.CoreV1Api(
        config.new_client_from_config(config_file=devstack.env()["KUBETRAIN_ADMIN_KUBECONFIG"])
    )


@pytest.fixture(scope="module")
def digits(s3, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "digits.zip"
    subprocess.run(
        [str(TRAINER_PYTHON), "-m", "include.sample_data.digits", "--out", str(path)], cwd=REPO, check=True
    )
    s3.upload_file(str(path), "datasets", "e2e-sweep-digits/digits.zip")
    return "s3://datasets/e2e-sweep-digits/"


@pytest.fixture(scope="module")
def sweeps_airflow(airflow, tmp_path_factory):
    """The session's Airflow runner over a dags folder of the project's DAGs plus a third-party sweep."""
    folder = tmp_path_factory.mktemp("sweep-dags")
    for name in ("sweep_image_classifier.py",):
        shutil.copy(REPO / "dags" / name, folder / name)
    shutil.copy(Path(__file__).parent / "sweep_dags" / f"{CUSTOM_DAG_ID}.py", folder / f"{CUSTOM_DAG_ID}.py")
    return type(airflow)(airflow.home, airflow.stack_env, folder)


def keys(s3, prefix: str, bucket: str = "training") -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def read_json(s3, key: str, bucket: str = "training"):
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def metrics_of(s3, run_uri: str) -> dict:
    """A trial's metrics.json, from its run URI (``s3://training/runs/...``)."""
    return read_json(s3, f"{run_uri.removeprefix('s3://training/').rstrip('/')}/output/metrics.json")


def pods(core, dag_id: str) -> list:
    return core.list_namespaced_pod(NAMESPACE, label_selector=f"kubetrain.io/dag-id={dag_id}").items


def assert_no_pods_left(core, dag_id: str) -> None:
    deadline = time.monotonic() + 60
    while pods(core, dag_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p.metadata.name for p in pods(core, dag_id)] == [], f"pods left behind by {dag_id}"


class PodWatch:
    """Records every pod of a DAG that appears, and kills one trial's pod once after its first epoch checkpoint."""

    def __init__(self, core, dag_id: str, kill_trial: str | None, epochs: int = 4):
        self.core, self.dag_id, self.kill_trial = core, dag_id, kill_trial
        self.last_epoch = epochs
        self.seen: set[str] = set()
        self.images: set[tuple[str, str]] = set()  # (container, image) of every trial's pod seen
        self.killed: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                found = pods(self.core, self.dag_id)
            except Exception:
                found = []
            for pod in found:
                self.seen.add(pod.metadata.name)
                labels = pod.metadata.labels or {}
                if "kubetrain.io/trial" in labels:
                    containers = (pod.spec.init_containers or []) + pod.spec.containers
                    self.images.update((c.name, c.image) for c in containers)
                if (
                    self.killed
                    or self.kill_trial is None
                    or labels.get("kubetrain.io/trial") != self.kill_trial
                    or pod.metadata.deletion_timestamp
                    or pod.status.phase != "Running"
                ):
                    continue
                try:
                    log = self.core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE, container="base")
                except client.ApiException:
                    continue
                # Only while it trains, between its first epoch's checkpoint and its last epoch: a
                # pod killed once its trainer has finished (a fast epoch, a slow look) tests no resume.
                base = next((c for c in pod.status.container_statuses or [] if c.name == "base"), None)
                epochs = log.count(" written (end of epoch;")
                if base is not None and base.state.running and 1 <= epochs < self.last_epoch:
                    self.core.delete_namespaced_pod(pod.metadata.name, NAMESPACE)
                    self.killed.append(f"{pod.metadata.name} after {epochs} epoch(s)")
            self.stop.wait(0.5)


# the grid sweep's conf and trials, for the median stopping test that reuses them
GRID: dict = {}


def test_grid_sweep_a_killed_trial_promotion_and_reuse(sweeps_airflow, devstack, core, s3, digits):
    conf = {
        "dataset_uri": digits,
        "model_name": "e2e-sweep-digits",
        "epochs": 4,
        "image_size": 16,
        "learning_rate": 0.001,
        "cpu": "1",
        "memory": "2Gi",
        "sync_interval": 2,
        "space": {"batch_size": [16, 32, 64, 128]},
        "algorithm": "grid",
        "max_trials": 4,
        "parallel_trials": 2,
        "early_stopping": {"rule": "off"},
    }
    with PodWatch(core, DAG_ID, kill_trial="0") as watch:
        run = sweeps_airflow.dags_test(DAG_ID, conf, **FAST)
    assert run.returncode == 0 and run.state() == "success", run.output[-6000:]
    states = run.task_states()
    assert {k: v for k, v in states.items() if "train" in k} == {
        "round_0.train_1_at_a_time": "skipped",
        "round_0.train_2_at_a_time[0]": "success",
        "round_0.train_2_at_a_time[1]": "success",
        "round_0.train_2_at_a_time[2]": "success",
        "round_0.train_2_at_a_time[3]": "success",
        "round_0.train_4_at_a_time": "skipped",
        "round_1.train": "skipped",
        "round_2.train": "skipped",
        "round_3.train": "skipped",
    }, states
    for task in ("stage_dataset", "plan", "round_0.suggest", "leaderboard", "promote", "record"):
        assert states[task] == "success", (task, states)
    assert watch.killed, "the trial's pod was never killed: the test did not exercise resume"
    # trials wait for their pods in their task process: every container's lines reach the task log,
    # the training container's as they come, the sidecar's (down to its final pass) when the pod ends
    lines = run.output.splitlines()
    for container, text in (
        ("stage-in", "stage-in"),
        ("base", "written (end of epoch;"),
        ("checkpoint-sync", "final pass"),
    ):
        assert any(f"[{container}] " in line and text in line for line in lines), (
            container,
            text,
            run.output[-4000:],
        )

    sweep = S3Layout().run(DAG_ID, run.run_id).prefix
    record = read_json(s3, f"{sweep}/sweep/sweep.json")
    assert record["kind"] == "kubetrain/sweep" and record["algorithm"] == "grid"
    assert record["space"] == {"batch_size": {"choices": [16, 32, 64, 128]}}
    assert record["dataset"]["version"] and "@sha256:" in record["image"]
    # the plan pinned both images once: every trial's pod ran those digests
    plan = read_json(s3, f"{sweep}/sweep/plan.json")
    assert plan["image"] == record["image"] and "@sha256:" in plan["sync_image"], plan
    assert watch.images == {
        ("stage-in", plan["sync_image"]),
        ("checkpoint-sync", plan["sync_image"]),
        ("base", plan["image"]),
    }, watch.images
    trials = {t["number"]: t for t in record["trials"]}
    assert sorted(trials) == [0, 1, 2, 3]
    assert [trials[n]["params"] for n in range(4)] == [{"batch_size": b} for b in (16, 32, 64, 128)]
    assert all(
        t["status"] == "success" and not t["stopped_early"] and t["reports"] == 4 for t in trials.values()
    ), trials
    # the trainers' compute in GPU-hours of the 1 GPU each trial asks for (the DAG's default, which
    # the dev stack serves on CPU): nothing stopped, nothing saved
    compute = record["compute"]
    assert compute["accelerator"] == "gpu" and compute["trials"] == 4 and compute["compute_used"] > 0, compute
    assert compute["compute_full"] == compute["compute_used"] and compute["saved_fraction"] == 0, compute
    assert compute["line"].startswith("no early stopping: 4 trial(s) used"), compute

    # the killed trial resumed from its checkpoint in a new pod of the same try (a deletion costs no retry)
    killed = read_json(s3, f"{sweep}/sweep/trials/0.json")
    summary = {k: killed.get(k) for k in ("resumed_from_step", "exit_code", "steps", "timing")}
    assert killed["resumed_from_step"] > 0 and killed["timing"]["try_number"] == 1, (watch.killed, summary)
    # the steps after the pod are stamped in order (the sweep bench splits a trial's overhead by them)
    timing = killed["timing"]
    stamps = [datetime.fromisoformat(timing[key]) for key in ("pod_done", "final_pass", "report", "recorded")]
    assert stamps == sorted(stamps), timing
    assert datetime.fromisoformat(timing["base"]["finished"]) <= stamps[0], timing

    # the prepared copy (#54), counted by each trial's trainer in its metrics.json: the trials start in
    # any order, 2 at a time, so the first pod of each of the first two may decode (neither finds a copy
    # in S3: a sidecar uploads one once it is made); every later pod finds the copy and decodes nothing,
    # the killed trial's replacement pod (whose metrics.json this is) among them
    prepared = {n: metrics_of(s3, trials[n]["run_uri"])["prepared"] for n in range(4)}
    reused = {"made": False, "decoded": 0}
    makers = sorted(n for n, p in prepared.items() if p["made"])
    assert all(prepared[n] == {"made": True, "decoded": DIGITS} for n in makers), prepared
    assert all(prepared[n] == reused for n in prepared if n not in makers), prepared
    assert len(makers) <= 2 and 0 not in makers, prepared
    copies_prefix = prepared_uri_of(plan["dataset"]["manifest"]).removeprefix("s3://training/")
    copies = [k for k in keys(s3, copies_prefix) if k.endswith("/manifest.json")]
    assert len(copies) == 1, copies  # one preprocessing (16 px, 3 channels): one copy, however many made it

    # the best trial is promoted, with the leaderboard linking every trial's report
    best = max((t for t in trials.values()), key=lambda t: t["objective"]["value"])
    assert record["best"]["best_trial"] == best["trial"]
    latest = read_json(s3, "models/e2e-sweep-digits/latest")
    assert latest["run_uri"] == best["run_uri"] and record["promotion"]["promoted"] is True
    html = s3.get_object(Bucket="training", Key=f"{sweep}/report/report.html")["Body"].read().decode()
    assert "data:image/png;base64," in html and "parallel_coordinates.png" in html
    for trial in trials.values():
        assert trial["report_url"] and trial["report_url"] in html
        assert trial["report_url"].startswith(f"/kubetrain/reports/{DAG_ID}/training/")
    assert_no_pods_left(core, DAG_ID)
    assert_trials_on_the_training_page(devstack.env(), run.run_id, trials, best["trial"])

    # the same sweep again: every trial is reused by fingerprint, no pod starts
    with PodWatch(core, DAG_ID, kill_trial=None) as again_watch:
        again = sweeps_airflow.dags_test(DAG_ID, conf, **FAST)
    assert again.returncode == 0 and again.state() == "success", again.output[-4000:]
    assert again_watch.seen == set(), f"the re-run started pods: {again_watch.seen}"
    assert again.task_states()["round_0.train_2_at_a_time"] == "skipped"
    again_record = read_json(s3, f"{S3Layout().run(DAG_ID, again.run_id).prefix}/sweep/sweep.json")
    assert [t["reused_from"]["run_uri"] for t in again_record["trials"]] == [
        trials[n]["run_uri"] for n in range(4)
    ]
    assert [t["objective"]["value"] for t in again_record["trials"]] == [
        trials[n]["objective"]["value"] for n in range(4)
    ]
    assert again_record["promotion"]["promoted"] is False  # not better than itself
    GRID.update(conf=conf, trials=trials)


def assert_trials_on_the_training_page(stack_env: dict, run_id: str, trials: dict, best: str) -> None:
    """Every trial left a run record, and the Training page's sweep view ranks them with the promoted one first."""
    import os

    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from kubetrain.run_store import RunStore
    from kubetrain.ui.queries import RunFilter, TrainingQueries, sweep_time

    environ = dict(os.environ)
    os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = stack_env["AIRFLOW_CONN_AWS_DEFAULT"]
    try:
        q = TrainingQueries(RunStore(S3Hook(aws_conn_id="aws_default"), S3Layout()), [DAG_ID])
        runs = [
            r
            for r in q.runs(RunFilter(model="e2e-sweep-digits", dag_id=DAG_ID), limit=500).runs
            if r["run_id"] == run_id
        ]
        assert sorted(r["trial"] for r in runs) == ["0", "1", "2", "3"], runs
        ranked = q.sweep(model="e2e-sweep-digits", dag_id=DAG_ID, run_id=run_id, run_time=sweep_time(runs[0]))
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert [r["trial"] for r in ranked][0] == best, ranked
    assert [r["sweep"]["objective"]["value"] for r in ranked] == sorted(
        (t["objective"]["value"] for t in trials.values()), reverse=True
    )
    for r in ranked:
        number = int(r["trial"])
        assert r["status"] == "success" and r["sweep"]["params"] == trials[number]["params"], r
        assert r["run_uri"] == trials[number]["run_uri"] and r["report_url"] == trials[number]["report_url"]
        assert r["promotion"]["promoted"] is (r["trial"] == best), r["promotion"]
        assert r["metrics"]["final"], r  # read from the trial's metrics.json
    from kubetrain.sweep.records import runs_compute

    # the sweep view shows the sweep's compute, which every trial's run record carries
    assert runs_compute(ranked)["line"].startswith("no early stopping: 4 trial(s) used"), ranked


def test_median_stopping_stops_a_bad_learning_rate(sweeps_airflow, core, s3):
    if not GRID:
        pytest.skip("needs the trials of the grid sweep above")
    conf, trials = GRID["conf"], GRID["trials"]
    # median stopping: a learning rate of 1e-6 (the model barely moves) next to the good 0.001 at
    # batch size 16. The good point was trained above and is reused (a finished trial from the
    # start), so the bad one falls below the median after its first report and stops; nothing is
    # retried. Batch size 16 (the grid's longest epochs, 90 steps) and a decision from the first
    # report on leave the rule three epochs to act in; the sidecar checks it about once a second
    # in a thread beside its passes (a batch-32 trial of 4 short epochs once ended inside one slow
    # pass, when the rule was checked only between passes; tests/trainer/sync/test_median_stop.py
    # holds that case). sync_interval is not part of the fingerprint, so the good point is reused.
    median = {
        **conf,
        "space": {"batch_size": [16], "learning_rate": [0.001, 0.000001]},
        "early_stopping": {"rule": "median", "min_trials": 1, "start_step": 1},
        "sync_interval": 1,
    }
    stop = sweeps_airflow.dags_test(DAG_ID, median, **FAST)
    assert stop.returncode == 0 and stop.state() == "success", stop.output[-6000:]
    stop_record = read_json(s3, f"{S3Layout().run(DAG_ID, stop.run_id).prefix}/sweep/sweep.json")
    by_lr = {
        lr: [t for t in stop_record["trials"] if t["params"]["learning_rate"] == lr]
        for lr in (0.001, 0.000001)
    }
    assert [t["reused_from"]["run_uri"] for t in by_lr[0.001]] == [trials[0]["run_uri"]]
    assert len(by_lr[0.000001]) == 1
    trial = by_lr[0.000001][0]
    assert trial["status"] == "success" and trial["stopped_early"], trial
    decision = trial["early_stop"]
    assert decision["rule"] == "median" and decision["step"] >= 1 and decision["best"] < decision["median"]
    # decided before the last epoch; the epoch under way when the stop file appears is closed
    assert decision["step"] < 4 and trial["reports"] <= 4
    assert trial["exit_code"] == 79
    assert trial["timing"]["try_number"] == 1  # a success, not retried
    # the leaderboard shows the compute the stop saved (the reused trial ran nothing in this sweep)
    compute = stop_record["compute"]
    assert compute["compute_full"] >= compute["compute_used"] > 0 and compute["reused"] == 1, compute
    report = S3Layout().run(DAG_ID, stop.run_id).key("report", "report.md")
    markdown = s3.get_object(Bucket="training", Key=report)["Body"].read().decode()
    assert "| Compute | early stopping (median) stopped 1 of 1 trials and saved " in markdown, markdown
    stop_states = stop.task_states()
    stopped_tasks = [k for k in stop_states if k.startswith("round_0.train_2_at_a_time[")]
    assert len(stopped_tasks) == 1 and all(stop_states[k] == "success" for k in stopped_tasks), stop_states
    assert (
        stop_record["best"]["best_run_uri"]
        == max(by_lr[0.001], key=lambda t: t["objective"]["value"])["run_uri"]
    )
    assert_no_pods_left(core, DAG_ID)


def test_asha_stops_a_bad_learning_rate_at_its_first_rung_and_a_rerun_starts_no_pod(sweeps_airflow, core, s3):
    if not GRID:
        pytest.skip("needs the trials of the grid sweep above")
    conf, trials = GRID["conf"], GRID["trials"]
    # asha, rungs at 1, 3 reports (eta 3, the budget of 4 epochs): the good point (0.001 at batch 16)
    # was trained by the grid sweep and is reused, so its record is at rung 1 before the bad point
    # (1e-6) reports; 2 trials at rung 1, the top max(1, 2 // 3) = 1 goes on: the bad one stops at
    # its first report, ranked 2 of 2 (tests/trainer/sync/test_asha.py holds the rule's table).
    asha = {
        **conf,
        "space": {"batch_size": [16], "learning_rate": [0.001, 0.000001]},
        "early_stopping": {"rule": "asha", "min_resource": 1, "reduction_factor": 3, "max_resource": 4},
        "sync_interval": 1,
    }
    stop = sweeps_airflow.dags_test(DAG_ID, asha, **FAST)
    assert stop.returncode == 0 and stop.state() == "success", stop.output[-6000:]
    sweep = S3Layout().run(DAG_ID, stop.run_id).prefix
    record = read_json(s3, f"{sweep}/sweep/sweep.json")
    good, bad = sorted(record["trials"], key=lambda t: -t["params"]["learning_rate"])
    assert good["reused_from"]["run_uri"] == trials[0]["run_uri"] and not good["stopped_early"]
    assert bad["status"] == "success" and bad["stopped_early"] and bad["exit_code"] == 79, bad
    decision = bad["early_stop"]
    ranked = (decision["rule"], decision["rung"], decision["rank"], decision["rung_trials"])
    assert ranked == ("asha", 1, 2, 2), decision
    assert decision["cutoff"] == good["objective"]["values"][0] and decision["value"] < decision["cutoff"]
    assert bad["reports"] < 4 and bad["timing"]["try_number"] == 1
    # the trial published its reports for the others at its rung
    assert keys(s3, f"{sweep}/sweep/rungs/") == [f"{sweep}/sweep/rungs/{bad['number']}.json"]
    # the leaderboard names the rung and the compute the stop saved
    markdown = s3.get_object(Bucket="training", Key=f"{sweep}/report/report.md")["Body"].read().decode()
    assert "stopped early at rung 1 (report " in markdown and ", rank 2 of 2)" in markdown, markdown
    assert "| Compute | early stopping (asha) stopped 1 of 1 trials and saved " in markdown, markdown
    assert_no_pods_left(core, DAG_ID)

    # the same asha sweep again: the good trial and the stopped one (same settings) are reused, no pod
    with PodWatch(core, DAG_ID, kill_trial=None) as again_watch:
        again = sweeps_airflow.dags_test(DAG_ID, asha, **FAST)
    assert again.returncode == 0 and again.state() == "success", again.output[-4000:]
    assert again_watch.seen == set(), f"the re-run started pods: {again_watch.seen}"
    again_record = read_json(s3, f"{S3Layout().run(DAG_ID, again.run_id).prefix}/sweep/sweep.json")
    assert sorted(t["reused_from"]["run_uri"] for t in again_record["trials"]) == sorted(
        [good["reused_from"]["run_uri"], bad["run_uri"]]
    )


def test_invalid_spaces_are_refused_before_any_pod(sweeps_airflow, core, digits):
    # the Param's schema refuses an unknown hyperparameter: no run is created
    run = sweeps_airflow.dags_test(DAG_ID, {"dataset_uri": digits, "space": {"momentum": [0.9]}}, **FAST)
    assert run.returncode != 0 and run.run_id is None, run.output[-3000:]
    assert "space" in run.output and "momentum" in run.output
    # low > high passes the schema; the plan task refuses it, naming the field, and nothing trains
    run = sweeps_airflow.dags_test(
        DAG_ID, {"dataset_uri": digits, "space": {"learning_rate": {"low": 0.1, "high": 0.01}}}, **FAST
    )
    assert run.state() == "failed"
    assert run.task_states()["plan"] == "failed" and run.try_numbers("plan") == 1  # not retried
    assert "space.learning_rate: low 0.1 > high 0.01" in run.output
    assert pods(core, DAG_ID) == []


SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    lr = float(args["lr"])
    out = os.environ["OUTPUT_DIR"]
    score = 1.0 - abs(lr - 0.01) * 10
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        for step in range(1, 4):
            f.write(json.dumps({"step": step, "score": score * step / 3}) + "\\n"); f.flush()
    print(f"trial lr={lr} score={score:.4f}", flush=True)
    """
)


def test_tpe_sweep_of_a_third_party_container_runs_two_rounds(sweeps_airflow, core, s3, digits):
    conf = {
        "dataset_uri": digits,
        "model_name": "e2e-sweep-script",
        # python:3.11-slim as the dev stack's mirror serves it, pinned by digest: a run never records a tag
        "image": mirror.pinned("python:3.11-slim"),
        "command": ["python", "-c", SCRIPT],
        "args": [],
        "space": {"lr": {"low": 0.0001, "high": 0.1, "log": True}},
        "algorithm": "tpe",
        "max_trials": 4,
        "parallel_trials": 2,
        "seed": 3,
        "objective": {"metric": "score", "mode": "max"},
    }
    run = sweeps_airflow.dags_test(CUSTOM_DAG_ID, conf, **FAST)
    assert run.returncode == 0 and run.state() == "success", run.output[-6000:]
    states = run.task_states()
    assert [states[f"round_0.train_2_at_a_time[{i}]"] for i in (0, 1)] == ["success"] * 2
    assert [states[f"round_1.train[{i}]"] for i in (0, 1)] == ["success"] * 2
    record = read_json(s3, f"{S3Layout().run(CUSTOM_DAG_ID, run.run_id).prefix}/sweep/sweep.json")
    assert [(t["number"], t["round"]) for t in record["trials"]] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    for trial in record["trials"]:
        lr = trial["params"]["lr"]
        assert f"trial lr={lr} " in run.output  # the container got --lr=<value>
        assert trial["objective"]["value"] == pytest.approx(1.0 - abs(lr - 0.01) * 10)
    # round 1 was asked for after round 0 finished, from its results (tells are in the log)
    assert "tpe round 1: the study is rebuilt from 2 earlier trial(s)" in run.output
    assert_no_pods_left(core, CUSTOM_DAG_ID)
