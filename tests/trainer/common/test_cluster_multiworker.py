"""Two real MultiWorkerMirroredStrategy workers on this machine (TF_CONFIG computed from the replica
variables): only the chief writes, SIGTERM on the other worker stops both at the same step, and both
resume from the chief's checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_support import free_hosts

from trainer.common.contract import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.slow]
SIGTERM_SAVE = re.compile(r"checkpoint ckpt-(\d+) (?:written|already written at this step) \(SIGTERM")
RESUMED = re.compile(r"resumed from ckpt-(\d+)")


def start(tmp: Path, data: Path, index: int, hosts: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATA_DIR", "CHECKPOINT_DIR", "OUTPUT_DIR", "TF_CONFIG")
    }
    env.update(
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        KUBETRAIN_TF_REPLICAS='{"chief": 1, "worker": 1}',
        KUBETRAIN_TF_HOSTS=hosts,
        JOB_COMPLETION_INDEX=str(index),
        KUBETRAIN_TF_ROLE="chief" if index == 0 else "worker",
    )
    if index == 1:
        env["KUBETRAIN_TF_ROLE"], env["JOB_COMPLETION_INDEX"] = "worker", "0"
    log = tmp / f"log{index}-{time.monotonic_ns()}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainer.image_classifier",
                "--data-dir",
                str(data),
                "--checkpoint-dir",
                str(tmp / f"ckpt{index}"),
                "--output-dir",
                str(tmp / f"out{index}"),
                "--image-size",
                "16",
                "--batch-size",
                "32",
                "--checkpoint-every-steps",
                "3",
                "--log-every-steps",
                "2",
                *extra,
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, log


def wait_for_text(log: Path, pattern: str, proc: subprocess.Popen, other: Path, timeout: float = 600) -> None:
    """Wait for ``pattern`` in ``log``; a failure shows both workers' logs (the other one's crash is
    what the first one reports only as "unhealthy")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text()):
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"exited {proc.returncode} before {pattern!r}: {log.read_text()[-3000:]}\n"
                f"--- the other worker's log:\n{other.read_text()[-3000:]}"
            )
        time.sleep(0.2)
    raise AssertionError(
        f"no {pattern!r} within {timeout} s: {log.read_text()[-3000:]}\n"
        f"--- the other worker's log:\n{other.read_text()[-3000:]}"
    )


def test_sigterm_on_a_worker_stops_both_and_both_resume_from_the_chiefs_checkpoint(tmp_path, data):
    hosts = free_hosts(2)
    (tmp_path / "ckpt1").mkdir()
    chief, chief_log = start(tmp_path, data, 0, hosts, "--epochs", "40")
    worker, worker_log = start(tmp_path, data, 1, hosts, "--epochs", "40")
    try:
        wait_for_text(chief_log, r"checkpoint ckpt-\d+ written \(every", chief, worker_log)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(300) == EXIT_PREEMPTED, worker_log.read_text()[-3000:]
        assert chief.wait(300) == EXIT_PREEMPTED, chief_log.read_text()[-3000:]
    finally:
        for proc in (chief, worker):
            if proc.poll() is None:
                proc.kill()
    chief_text, worker_text = chief_log.read_text(), worker_log.read_text()
    assert (
        "collective ring of 2 worker(s) is up" in chief_text
        and "collective ring of 2 worker(s) is up" in worker_text
    )
    assert "another worker received SIGTERM" in chief_text
    stopped = {int(SIGTERM_SAVE.search(t).group(1)) for t in (chief_text, worker_text)}
    assert len(stopped) == 1, "the two workers checkpointed at different steps"
    step = stopped.pop()
    # Only the chief wrote the synced directories.
    assert (tmp_path / "ckpt0" / f"ckpt-{step}.index").exists() and (
        tmp_path / "out0" / "params.json"
    ).exists()
    assert list((tmp_path / "ckpt1").iterdir()) == [] and not any((tmp_path / "out1").glob("*"))

    # What every replica's stage-in does: restore the chief's checkpoints into its CHECKPOINT_DIR.
    shutil.rmtree(tmp_path / "ckpt1")
    shutil.copytree(tmp_path / "ckpt0", tmp_path / "ckpt1")
    before = sorted(p.name for p in (tmp_path / "ckpt1").iterdir())
    chief, chief_log = start(tmp_path, data, 0, hosts, "--epochs", "3")
    worker, worker_log = start(tmp_path, data, 1, hosts, "--epochs", "3")
    try:
        assert chief.wait(600) == 0, chief_log.read_text()[-3000:]
        assert worker.wait(300) == 0, worker_log.read_text()[-3000:]
    finally:
        for proc in (chief, worker):
            if proc.poll() is None:
                proc.kill()
    chief_text, worker_text = chief_log.read_text(), worker_log.read_text()
    assert RESUMED.search(chief_text).group(1) == RESUMED.search(worker_text).group(1) == str(step)
    metrics = json.loads((tmp_path / "out0" / "metrics.json").read_text())
    assert (
        metrics["resumed_from_step"] == step
        and metrics["workers"] == 2
        and metrics["strategy"] == "multi_worker"
    )
    assert sorted(p.name for p in (tmp_path / "ckpt1").iterdir()) == before  # the worker wrote nothing there
    assert not any((tmp_path / "out1").glob("*"))
