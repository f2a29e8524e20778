"""A real parameter-server job on this machine: a chief (the coordinator), 2 workers and 1 ps, with
TF_CONFIG computed from the replica variables.

As in pods, every replica has a filesystem of its own: the workers and the ps run in a mount
namespace of their own with an empty tmpfs over the test's directory, so the chief's
CHECKPOINT_DIR and OUTPUT_DIR do not exist for them. The variables live on the ps; every
checkpoint and the SavedModel must still be written by the chief, into its own directories
(on the dev stack the ps once wrote the SavedModel's variables to a /output of its own and the
export failed with NOT_FOUND), and a new job resumes from them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_support import free_hosts

from trainer.common.export import latest_saved_model

REPO = Path(__file__).resolve().parents[3]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="a mount namespace per replica needs root (as the dev stack's pods)"
    ),
]
REPLICAS = '{"chief": 1, "worker": 2, "ps": 1}'
RESUMED = re.compile(r"resumed from ckpt-(\d+)")


def start(tmp: Path, data: Path, replica: int, hosts: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """Replica ``replica`` (0 chief, 1-2 workers, 3 ps); all but the chief see an empty ``tmp``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATA_DIR", "CHECKPOINT_DIR", "OUTPUT_DIR", "TF_CONFIG")
    }
    env.update(
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        KUBETRAIN_TF_REPLICAS=REPLICAS,
        KUBETRAIN_TF_HOSTS=hosts,
        JOB_COMPLETION_INDEX=str(replica),
    )
    command = [
        sys.executable,
        "-m",
        "trainer.image_classifier",
        "--data-dir",
        str(data),
        "--checkpoint-dir",
        str(tmp / "ckpt"),
        "--output-dir",
        str(tmp / "out"),
        "--image-size",
        "16",
        "--batch-size",
        "32",
        "--checkpoint-every-steps",
        "3",
        "--log-every-steps",
        "1",
        *extra,
    ]
    if replica:
        # a filesystem of its own: the chief's directories are not there
        command = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs tmpfs "$0" && exec "$@"',
            str(tmp),
            *command,
        ]
    log = tmp.parent / f"{tmp.name}-log{replica}-{time.monotonic_ns()}"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def run_job(tmp: Path, data: Path, *extra: str) -> str:
    """One job to its end: the chief's log (the other replicas are stopped as their engine would)."""
    hosts = free_hosts(4)
    procs = [start(tmp, data, replica, hosts, *extra) for replica in (3, 1, 2, 0)]
    chief, chief_log = procs[-1]
    try:
        code = chief.wait(600)
        text = chief_log.read_text()
        assert code == 0, text[-4000:] + "".join(log.read_text()[-1500:] for _, log in procs[:-1])
        for proc, log in procs[:-1]:
            assert proc.poll() is None, f"a replica ended before the chief: {log.read_text()[-2000:]}"
            assert "parameter-server mode:" in log.read_text() and "serves at grpc://" in log.read_text()
            proc.send_signal(signal.SIGTERM)  # the job's engine stops them once the chief has finished
        for proc, log in procs[:-1]:
            proc.wait(120)
            assert "stopping: the job is over" in log.read_text(), log.read_text()[-2000:]
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return text


def test_a_parameter_server_job_writes_checkpoints_and_model_through_the_chief_and_resumes(tmp_path, data):
    job = tmp_path / "job"
    job.mkdir()
    first = run_job(job, data, "--max-steps", "6")
    assert "ParameterServerStrategy" in first and "across 2 worker(s)" in first
    assert "checkpoint ckpt-6 written" in first, first[-3000:]
    out = job / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["strategy"], metrics["workers"], metrics["parameter_servers"], metrics["steps"]) == (
        "parameter_server",
        2,
        1,
        6,
    )
    # the SavedModel's variables and the Keras model, written by the chief from the ps's variables
    version = latest_saved_model(out / "saved_model")
    assert (version / "saved_model.pb").exists()
    assert any((version / "variables").glob("variables.data-*"))
    assert (out / "model.keras").stat().st_size > 0
    assert (job / "ckpt" / "ckpt-6.index").exists()

    # a new job (every replica restarted) resumes from the chief's checkpoint, not from step 0
    second = run_job(job, data, "--max-steps", "9")
    assert RESUMED.search(second) and RESUMED.search(second).group(1) == "6", second[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 6 and metrics["steps"] == 9
