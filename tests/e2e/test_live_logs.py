"""The train task's log follows the trainer while the task is deferred, read as a user reads it.

Airflow runs for real (API server, scheduler, DAG processor and triggerer: `airflow dags test`
runs a deferred task's trigger in its own process, not in a triggerer), train_image_classifier
is triggered through the REST API with many epochs, and while the train task is deferred its
log, read through the REST API, holds trainer lines of an epoch that has not finished yet, at
most 30 s after the pod wrote them (as `kubectl logs --timestamps` dates them). The same log
page in the UI shows them too (screenshot kept). The run is then failed, which stops its pod.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from datetime import datetime

import pendulum
import pytest
from ui_support import DAG_ID, log_in, shot

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EPOCHS = 1000  # far more than the test waits for: the run is stopped once the log has shown its lines
MAX_DELAY_S = 30
STEP = re.compile(
    r"\[base\] .*\bstep (\d+) epoch (\d+)/(\d+) batch (\d+)/(\d+) loss [0-9.]+ .*examples/s [0-9.]+ input wait .*? eta \d+[hm]\d\d[ms]"
)


def log_entries(ui, run_id: str, task_id: str, try_number: int) -> list[dict]:
    """The task try's log as the REST API gives it: structured entries with ``event`` and ``timestamp``."""
    quoted = urllib.parse.quote(run_id, safe="")
    body = ui.api(
        "GET", f"/dags/{DAG_ID}/dagRuns/{quoted}/taskInstances/{task_id}/logs/{try_number}?full_content=true"
    )
    content = body.get("content") or []
    return [entry for entry in content if isinstance(entry, dict)]


def kubelet_times(stack_env: dict[str, str], pod_name: str, namespace: str) -> dict[str, datetime]:
    """Each line of the pod's training container, with the time the kubelet logged it (kubectl logs --timestamps)."""
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(stack_env["KUBETRAIN_ADMIN_KUBECONFIG"]))
    raw = api.read_namespaced_pod_log(
        pod_name, namespace, container="base", timestamps=True, _preload_content=False
    ).data.decode("utf-8", errors="replace")
    times = {}
    for line in raw.splitlines():
        stamp, _, message = line.partition(" ")
        times.setdefault(message, pendulum.parse(stamp))
    return times


def test_train_log_shows_epochs_while_the_task_is_deferred(ui, devstack, page, tmp_path):
    from playwright.sync_api import expect

    ui.set_paused(DAG_ID, False)
    try:
        run_id = ui.trigger(DAG_ID, {"epochs": EPOCHS, "batch_size": 8, "image_size": 16, "force": True})
        try:
            found = follow_train_log(ui, devstack.env(), run_id)
            step, epoch = found["step"], found["epoch"]
            print(
                f"step {step} of epoch {epoch}/{EPOCHS} reached the task log {found['delay']:.1f} s after the pod wrote it"
            )
            delays = found["delays"]
            print(
                f"{len(delays)} trainer lines: median {delays[len(delays) // 2]:.1f} s, "
                f"max {delays[-1]:.1f} s behind the pod"
            )

            # The UI's log page of the task shows step lines while the task is still deferred (the
            # page renders only the lines in view of a log that grows by several lines a second,
            # so any step line of the run, not necessarily the one read above).
            quoted = urllib.parse.quote(run_id, safe="")
            log_in(page, ui, f"/dags/{DAG_ID}/runs/{quoted}/tasks/train")
            line = page.get_by_text(re.compile(rf"step \d+ epoch \d+/{EPOCHS} batch \d+/\d+ loss")).first
            expect(line).to_be_visible(timeout=60_000)
            assert ui.task_instances(DAG_ID, run_id)["train"]["state"] == "deferred"
            shot(page, tmp_path, "train-log-while-deferred")
        finally:
            # Failing the run cancels the deferred task's trigger, which deletes the pod.
            ui.set_run_state(DAG_ID, run_id, "failed")
            ui.wait_run(DAG_ID, run_id, timeout=120)
    finally:
        ui.set_paused(DAG_ID, True)


def follow_train_log(ui, stack_env: dict[str, str], run_id: str, timeout: float = 420) -> dict:
    """Poll the train task's log until it shows a step line of an unfinished epoch while the task is deferred."""
    deadline = time.monotonic() + timeout
    seen_deferred = False
    while time.monotonic() < deadline:
        ui.check_alive()
        tis = ui.task_instances(DAG_ID, run_id)
        train = tis.get("train") or {}
        state = train.get("state")
        if state in ("failed", "upstream_failed", "success", "skipped"):
            raise AssertionError(
                f"the train task ended ({state}) before its log showed a running epoch: {tis}"
            )
        if state != "deferred":
            time.sleep(2)
            continue
        seen_deferred = True
        entries = log_entries(ui, run_id, "train", train["try_number"])
        events = [str(e.get("event", "")) for e in entries]
        finished_epochs = {
            int(m.group(1)) for e in events if (m := re.search(r"\[base\] .*\bepoch (\d+): loss", e))
        }
        for entry in entries:
            match = STEP.search(str(entry.get("event", "")))
            if not match:
                continue
            step, epoch, total = (int(g) for g in match.group(1, 2, 3))
            if epoch in finished_epochs or epoch >= total:
                continue
            # Still deferred after the read: the epoch was in progress while the log showed it.
            if ui.task_instances(DAG_ID, run_id)["train"]["state"] != "deferred":
                break
            assert total == EPOCHS
            message = str(entry["event"]).split("[base] ", 1)[1]
            xcoms = f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances/train/xcomEntries"
            pod = ui.api("GET", f"{xcoms}/pod_name")["value"]
            namespace = ui.api("GET", f"{xcoms}/pod_namespace")["value"]
            kubelet = kubelet_times(stack_env, pod, namespace)
            written = kubelet.get(message)
            assert written is not None, f"{message!r} is not in the pod's log"
            logged = pendulum.parse(str(entry["timestamp"]))
            delay = (logged - written).total_seconds()
            assert delay <= MAX_DELAY_S, f"the line reached the task log {delay:.1f} s after the pod wrote it"
            # every trainer line logged so far, against when the pod wrote it: the lag over the run
            delays = sorted(
                (pendulum.parse(str(e["timestamp"])) - kubelet[text]).total_seconds()
                for e in entries
                if "[base] " in str(e.get("event", ""))
                and (text := str(e["event"]).split("[base] ", 1)[1]) in kubelet
            )
            assert delays and delays[-1] <= MAX_DELAY_S, delays[-10:]
            # the lines follow a header that says the pod runs, not the provider's "Waiting ... scheduled"
            assert any("is running: its containers' lines follow" in e for e in events), events[:40]
            return {"step": step, "epoch": epoch, "delay": delay, "delays": delays}
        time.sleep(3)
    raise AssertionError(
        f"no trainer line of a running epoch in the train task's log within {timeout:.0f} s "
        f"(deferred seen: {seen_deferred}); last lines: {events[-15:] if seen_deferred else []}"
    )
