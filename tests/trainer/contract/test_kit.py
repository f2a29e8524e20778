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


@pytest.mark.parametrize(
    ("guarded", "sent"),
    [
        ((signal.SIGTERM,), signal.SIGTERM),  # the default: the kubelet's notice
        ((signal.SIGTERM, signal.SIGINT), signal.SIGINT),  # Ctrl-C too, when a script asks for it
    ],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_guarded_signal_becomes_a_flag_the_script_checks(guarded, sent):
    before = signal.getsignal(sent)
    with kit.PreemptionGuard(guarded) as guard:
        os.kill(os.getpid(), sent)
        assert guard.requested and guard.signal == sent  # still running: the script decides
    assert signal.getsignal(sent) == before  # the previous handler is back


SCRIPT = """
import os, sys, time
from kubetrain_contract import kit
guard = kit.PreemptionGuard() if os.environ["GUARD"] == "1" else None
print("ready", flush=True)
for step in range(1, 10**6):
    time.sleep(0.01)
    if guard is not None and guard.requested:
        (kit.checkpoint_dir() / "ckpt").write_text(str(step))
        sys.exit(kit.EXIT_PREEMPTED)
    if kit.should_stop():
        kit.write_metrics(monitor="loss", mode="min", final={"loss": 1.0, "step": step})
        sys.exit(kit.EXIT_STOPPED)
"""


def _send_sigterm(proc, pod):
    proc.send_signal(signal.SIGTERM)


def _write_stop_file(proc, pod):
    (pod / "checkpoint_dir" / ".kubetrain-stop").touch()


# (what reaches the script, with the guard?, its exit code, the file it leaves)
SIGNALS = [
    ("SIGTERM, guarded", _send_sigterm, True, kit.EXIT_PREEMPTED, "checkpoint_dir/ckpt"),
    ("SIGTERM, unguarded", _send_sigterm, False, -signal.SIGTERM, None),  # killed unsaved: exit 143 in a pod
    ("the stop file", _write_stop_file, True, kit.EXIT_STOPPED, "output_dir/metrics.json"),
]


@pytest.mark.parametrize(
    ("send", "guard", "code", "left"), [row[1:] for row in SIGNALS], ids=[row[0] for row in SIGNALS]
)
def test_each_signal_ends_a_script_with_its_code_and_its_file(pod, send, guard, code, left):
    env = {**os.environ, "PYTHONPATH": str(REPO / "trainer"), "GUARD": "1" if guard else "0"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    send(proc, pod)
    assert proc.wait(timeout=60) == code
    assert (kit.EXIT_PREEMPTED, kit.EXIT_STOPPED) == (75, 79)
    written = [
        p.relative_to(pod).as_posix() for p in pod.rglob("*") if p.is_file() and p.name != ".kubetrain-stop"
    ]
    assert written == ([left] if left else []), written
    if left == "checkpoint_dir/ckpt":
        assert int((pod / left).read_text()) >= 1
