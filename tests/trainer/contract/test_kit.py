"""The kit for users' training scripts (kubetrain_contract.kit): reports, atomic writers, the stop file and
the preemption guard, each as the sidecar's rules and the report read them."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kubetrain_contract import kit
from kubetrain_contract.reports import objective_reports, parse_jsonl

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def pod(tmp_path, monkeypatch):
    for name in ("DATA_DIR", "CHECKPOINT_DIR", "OUTPUT_DIR"):
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("KUBETRAIN_STOP_FILE", str(tmp_path / "checkpoint_dir" / ".kubetrain-stop"))
    return tmp_path


def test_reports_are_lines_the_stopping_rules_count(pod):
    kit.report(epoch=1, step=10, loss=0.9, val_accuracy=0.5)
    kit.report(step=15, loss=0.8)  # a step line without the objective: no report of it
    kit.report(epoch=2, step=20, loss=float("nan"), val_accuracy=float("inf"))
    rows = parse_jsonl((pod / "output_dir" / "metrics.jsonl").read_text())
    assert [r.get("epoch") for r in rows] == [1, None, 2]
    assert objective_reports(rows, "val_accuracy") == [
        0.5,
        None,
    ]  # a non-finite value is a report without one
    assert rows[2]["loss"] is None and all(isinstance(r["time"], float) for r in rows)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epoch": -1, "loss": 1.0}, "report epoch=-1 is not valid"),
        ({"epoch": 1.5, "loss": 1.0}, "report epoch=1.5 is not valid"),
        ({"step": True, "loss": 1.0}, "report step=True is not valid"),
        ({}, "report() needs at least one metric"),
    ],
)
def test_a_bad_report_is_refused_naming_the_value(pod, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kit.report(**kwargs)
    assert not (pod / "output_dir" / "metrics.jsonl").exists()


def test_a_torn_last_line_is_dropped_by_the_readers(pod):
    kit.report(epoch=1, val_loss=0.5)
    with open(pod / "output_dir" / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 2, "val_lo')  # a writer killed mid-line
    assert [r["epoch"] for r in parse_jsonl((pod / "output_dir" / "metrics.jsonl").read_text())] == [1]


@pytest.mark.parametrize(
    ("write", "name"),
    [
        (lambda: kit.write_metrics(monitor="val_loss", mode="min", final={"val_loss": 0.3}), "metrics.json"),
        (lambda: kit.write_history([{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.4}]), "history.csv"),
        (lambda: kit.write_json("samples.json", {"replies": ["hi"]}), "samples.json"),
    ],
)
def test_a_writer_killed_before_its_rename_leaves_the_old_file_and_no_partial_one(
    pod, monkeypatch, write, name
):
    target = pod / "output_dir" / name
    target.write_text("old")

    def killed(*args):
        raise KeyboardInterrupt  # the process dies between the write and the rename

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", killed)
        with pytest.raises(KeyboardInterrupt):
            write()
    assert target.read_text() == "old" and sorted(p.name for p in target.parent.iterdir()) == [name]
    write()
    assert target.read_text() != "old"


def test_metrics_and_history_are_what_the_report_reads(pod):
    kit.write_history([{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.4, "val_loss": math.nan}])
    assert (pod / "output_dir" / "history.csv").read_text().splitlines() == [
        "epoch,loss,val_loss",
        "1,0.5,",
        "2,0.4,",
    ]
    kit.write_metrics(
        monitor="val_accuracy",
        mode="max",
        final={"val_accuracy": 0.8},
        best={"epoch": 3, "val_accuracy": 0.9},
    )
    metrics = json.loads((pod / "output_dir" / "metrics.json").read_text())
    assert (metrics["monitor"], metrics["monitor_mode"], metrics["best"]["epoch"]) == (
        "val_accuracy",
        "max",
        3,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"monitor": "val_loss", "mode": "lowest", "final": {"val_loss": 1}}, "mode 'lowest' is not valid"),
        ({"monitor": "val_auc", "mode": "max", "final": {"val_loss": 1}}, "monitor 'val_auc' is in neither"),
    ],
)
def test_bad_metrics_are_refused(pod, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kit.write_metrics(**kwargs)


def test_the_stop_file_is_read_where_the_pod_says(pod):
    assert not kit.should_stop()
    (pod / "checkpoint_dir" / ".kubetrain-stop").touch()
    assert kit.should_stop() and kit.stop_file() == pod / "checkpoint_dir" / ".kubetrain-stop"


def test_the_directories_default_to_the_pod_contract(monkeypatch):
    for name in ("DATA_DIR", "CHECKPOINT_DIR", "OUTPUT_DIR", "KUBETRAIN_STOP_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert (kit.data_dir(), kit.checkpoint_dir(), kit.output_dir(), kit.stop_file()) == (
        Path("/data"),
        Path("/checkpoints"),
        Path("/output"),
        Path("/checkpoints/.kubetrain-stop"),
    )


def test_sigterm_becomes_a_flag_the_script_checks():
    with kit.PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested and guard.signal == signal.SIGTERM  # still running: the script decides
    assert signal.getsignal(signal.SIGTERM) is not guard._handle


SCRIPT = """
import sys, time
from kubetrain_contract import kit
guard = kit.PreemptionGuard()
print("ready", flush=True)
for step in range(1, 10**6):
    time.sleep(0.01)
    if guard.requested:
        (kit.checkpoint_dir() / "ckpt").write_text(str(step))
        sys.exit(kit.EXIT_PREEMPTED)
"""


def test_a_script_with_the_guard_saves_and_exits_75_instead_of_dying_with_143(pod):
    env = {**os.environ, "PYTHONPATH": str(REPO / "trainer")}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == kit.EXIT_PREEMPTED == 75
    assert int((pod / "checkpoint_dir" / "ckpt").read_text()) >= 1
