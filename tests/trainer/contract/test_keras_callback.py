"""The kit's Keras callback in a user's script: per-epoch reports, preemption that saves mid-epoch and resumes at
that step with the same number of optimizer steps, the stop file, a damaged checkpoint never trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kubetrain_contract.exit_codes import EXIT_OK, EXIT_PREEMPTED, EXIT_STOPPED
from kubetrain_contract.reports import parse_jsonl

SCRIPT = Path(__file__).with_name("keras_kit_script.py")
REPO = Path(__file__).resolve().parents[3]
EPOCHS, BATCHES = 4, 12


def run(tmp_path: Path, **env: str) -> tuple[int, dict]:
    dirs = {name: tmp_path / name.split("_")[0].lower() for name in ("CHECKPOINT_DIR", "OUTPUT_DIR")}
    for path in dirs.values():
        path.mkdir(exist_ok=True)
    environ = {
        **os.environ,
        **{k: str(v) for k, v in dirs.items()},
        "KUBETRAIN_STOP_FILE": str(tmp_path / "checkpoint" / ".kubetrain-stop"),
        "PYTHONPATH": str(REPO / "trainer"),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        **env,
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=environ, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return proc.returncode, json.loads(lines[-1])


def test_an_uninterrupted_run_reports_every_epoch_and_writes_the_outputs(tmp_path):
    code, out = run(tmp_path)
    assert code == EXIT_OK and out["steps"] == EPOCHS * BATCHES
    reports = parse_jsonl((tmp_path / "output" / "metrics.jsonl").read_text())
    assert [r["epoch"] for r in reports] == [1, 2, 3, 4] and all("val_accuracy" in r for r in reports)
    assert [r["step"] for r in reports] == [12, 24, 36, 48]
    metrics = json.loads((tmp_path / "output" / "metrics.json").read_text())
    assert (
        metrics["monitor"] == "val_accuracy" and metrics["monitor_mode"] == "max" and metrics["epochs"] == 4
    )
    assert metrics["best"]["val_accuracy"] == max(r["val_accuracy"] for r in reports)
    history = (tmp_path / "output" / "history.csv").read_text().splitlines()
    assert history[0].startswith("epoch,step,") and len(history) == 5


def test_a_preemption_mid_epoch_resumes_at_its_step_with_the_same_number_of_steps(tmp_path):
    # SIGTERM after step 29: epoch 3's fifth batch; the checkpoint before it was step 25 (every 5)
    code, first = run(tmp_path, KIT_SIGTERM_AT_STEP="29")
    assert code == EXIT_PREEMPTED and first["steps"] == 29
    (tmp_path / "output" / "metrics.jsonl").unlink()  # a new pod's OUTPUT_DIR is empty
    code, second = run(tmp_path)
    assert code == EXIT_OK
    assert second["resumed"] == [2, 5]  # epoch index 2 (the third), 5 batches in: the step SIGTERM saved
    # the callback trained the third epoch's last 7 batches (steps 30..36) before fit went on with the fourth
    assert second["trained"] == list(range(37, 49))
    assert second["steps"] == EPOCHS * BATCHES  # 29 + 7 + 12: none trained twice, none skipped
    reports = parse_jsonl((tmp_path / "output" / "metrics.jsonl").read_text())
    assert [r["epoch"] for r in reports] == [1, 2, 3, 4]  # the earlier epochs' reports came back


def test_the_stop_file_ends_training_with_outputs_and_the_stopped_code(tmp_path):
    code, out = run(tmp_path, KIT_STOP_AT_EPOCH="2")
    assert code == EXIT_STOPPED and out["steps"] == 2 * BATCHES
    metrics = json.loads((tmp_path / "output" / "metrics.json").read_text())
    assert metrics["stopped_early"] is True and metrics["epochs"] == 2


def test_a_damaged_newest_checkpoint_is_set_aside_and_an_older_one_used(tmp_path):
    code, _ = run(tmp_path, KIT_SIGTERM_AT_STEP="29")
    assert code == EXIT_PREEMPTED
    newest = max((tmp_path / "checkpoint" / "keras").glob("step-*"))
    weights = newest / "model.weights.h5"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short, as a pod killed mid-upload would leave it
    code, second = run(tmp_path)
    assert code == EXIT_OK and second["steps"] == EPOCHS * BATCHES
    assert second["resumed"] == [2, 1]  # step 25, the checkpoint before: epoch 3, one batch in
    assert (newest.parent / f".damaged-{newest.name}").is_dir()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "up"}, "mode 'up' is not valid"),
        ({"save_every_steps": -1}, "save_every_steps=-1 is not valid"),
        ({"keep": 0}, "keep=0 is not valid"),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs, message):
    from kubetrain_contract.keras_callback import KubetrainCallback

    with pytest.raises(ValueError, match=message):
        KubetrainCallback(**kwargs)
