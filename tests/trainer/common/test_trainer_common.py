"""Shared trainer pieces without TensorFlow: typed configs, the CLI, atomic writes, sample data."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from include.sample_data import dialogue as dialogue_data
from include.sample_data import digits as digits_data
from kubetrain_contract.exit_codes import EXIT_CODES
from kubetrain_contract.json_values import json_safe
from trainer.common.config import parse_config
from trainer.common.contract import EXIT_PREEMPTED, write_csv_atomic, write_json_atomic
from trainer.dialogue.train import DialogueConfig
from trainer.image_classifier.config import ClassifierConfig

REPO = Path(__file__).resolve().parents[3]
DIRS = {"data_dir": "/data", "checkpoint_dir": "/checkpoints", "output_dir": "/output"}


@pytest.mark.parametrize(
    ("cls", "values", "message"),
    [
        (ClassifierConfig, {"batch_size": 0}, "--batch-size must be an integer >= 1, got 0"),
        (ClassifierConfig, {"epochs": -1}, "--epochs must be an integer >= 1, got -1"),
        (
            ClassifierConfig,
            {"validation_split": 1.5},
            "--validation-split must be a fraction strictly between",
        ),
        (ClassifierConfig, {"learning_rate": 0.0}, "--learning-rate must be a number > 0 and <= 1, got 0.0"),
        (ClassifierConfig, {"max_steps": 0}, "--max-steps must be an integer >= 1 (or unset), got 0"),
        (
            ClassifierConfig,
            {"checkpoint_every_steps": -5},
            "--checkpoint-every-steps must be an integer >= 0",
        ),
        (ClassifierConfig, {"dropout": 1.0}, "--dropout must be a fraction in [0, 1), got 1.0"),
        (
            ClassifierConfig,
            {"model": "mobilenet_v2", "channels": 1},
            "--channels must be 3 with --model mobilenet_v2",
        ),
        (ClassifierConfig, {"model": "mobilenet_v2", "image_size": 16}, "--image-size must be >= 32 with"),
        (
            ClassifierConfig,
            {"weights": "/nowhere.weights.h5"},
            "--weights must be unset unless --model mobilenet_v2",
        ),
        (
            ClassifierConfig,
            {"model": "mobilenet_v2", "weights": "/nowhere.weights.h5"},
            "--weights must be an existing local weights file, got '/nowhere.weights.h5'",
        ),
        (ClassifierConfig, {"data_dir": None}, "no data dir: pass --data-dir or set DATA_DIR"),
        (
            DialogueConfig,
            {"hidden_size": 30, "num_heads": 4},
            "--hidden-size must be a multiple of --num-heads 4",
        ),
        (DialogueConfig, {"vocab_size": 4}, "--vocab-size must be an integer from 8 to 1000000, got 4"),
        (
            DialogueConfig,
            {"max_output_length": 1},
            "--max-output-length must be an integer from 2 to 1024, got 1",
        ),
        (DialogueConfig, {"clip_norm": -1.0}, "--clip-norm must be a number > 0, got -1.0"),
        (DialogueConfig, {"warmup_steps": 0}, "--warmup-steps must be an integer >= 1 (or unset), got 0"),
        (
            ClassifierConfig,
            {"steps_per_execution": 0},
            "--steps-per-execution must be an integer from 1 to 10000 (or unset), got 0",
        ),
        (ClassifierConfig, {"patience": -1}, "--patience must be an integer >= 0, got -1"),
        (
            ClassifierConfig,
            {"shuffle_buffer": -1},
            "--shuffle-buffer must be an integer >= 0 (0: a permutation of the whole split, no buffer)",
        ),
        (DialogueConfig, {"monitor": "loss"}, "--monitor must be one of val_accuracy, val_loss, got 'loss'"),
    ],
)
def test_config_refuses_bad_value_by_name(cls, values, message):
    with pytest.raises(ValueError) as info:
        cls(**{**DIRS, **values})
    assert message in str(info.value)


def test_cli_refuses_bad_flag_with_exit_2_naming_it(capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(
            ClassifierConfig,
            ["--batch-size", "0", *[f"--{k.replace('_', '-')}={v}" for k, v in DIRS.items()]],
            prog="t",
            description="",
            environ={},
        )
    assert info.value.code == 2
    assert "--batch-size must be an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(ClassifierConfig, ["--batch-size", "many"], prog="t", description="", environ={})
    assert "argument --batch-size: invalid int value: 'many'" in capsys.readouterr().err


def test_flags_win_over_environment_and_environment_fills_the_rest():
    env = {"DATA_DIR": "/env/data", "CHECKPOINT_DIR": "/env/ckpt", "OUTPUT_DIR": "/env/out"}
    config = parse_config(
        ClassifierConfig,
        ["--data-dir", "/flag/data", "--no-augment", "--epochs", "3"],
        prog="t",
        description="",
        environ=env,
    )
    assert (config.data_dir, config.checkpoint_dir, config.output_dir) == (
        "/flag/data",
        "/env/ckpt",
        "/env/out",
    )
    assert config.augment is False and config.epochs == 3
    hyper = config.hyperparameters()
    assert hyper["epochs"] == 3 and "data_dir" not in hyper and "output_dir" not in hyper


def test_help_documents_exit_codes_and_every_flag():
    for module in ("trainer.image_classifier", "trainer.dialogue"):
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
        assert f"{EXIT_PREEMPTED}" in out and "SIGTERM" in out and "--checkpoint-every-steps" in out
        assert "DATA_DIR" in out and "KUBETRAIN_DATASET_VERSION" in out
        # the exit codes as the contract's table says them, each once, in its order
        section = " ".join(out.split("exit codes:")[1].split("environment")[0].split())
        for entry in EXIT_CODES:
            assert f"{entry.code} {entry.meaning}" in section, (entry, section)
            assert not entry.advice or entry.advice in section
        assert [int(w) for w in section.split() if w.isdigit()][: len(EXIT_CODES)] == [
            e.code for e in EXIT_CODES
        ]
    dialogue_help = subprocess.run(
        [sys.executable, "-m", "trainer.dialogue", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--num-layers",
        "--num-heads",
        "--hidden-size",
        "--ff-size",
        "--dropout",
        "--warmup-steps",
        "--clip-norm",
        "--max-input-length",
        "--max-output-length",
        "--sample-every-steps",
    ):
        assert flag in dialogue_help


def test_trainer_package_and_data_modules_do_not_load_tensorflow():
    code = (
        "import sys, trainer, trainer.image_classifier, trainer.image_classifier.train, trainer.image_classifier.data, trainer.dialogue.train, trainer.dialogue.data; "
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_atomic_writes_leave_no_temporary_files(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": float("nan"), "y": [1.5, float("inf")]})
    write_csv_atomic(tmp_path / "h.csv", ["epoch", "loss"], [[1, 0.5], [2, 0.25]])
    write_json_atomic(tmp_path / "a.json", {"x": 2})  # replaces the first version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "h.csv"]
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 2}
    assert (tmp_path / "h.csv").read_text() == "epoch,loss\n1,0.5\n2,0.25\n"
    assert json_safe({"a": [float("nan")], "b": 1.0}) == {"a": [None], "b": 1.0}


def test_digits_generator_is_deterministic_and_injects_unreadable_files(tmp_path):
    for name in ("a.zip", "b.zip"):
        assert digits_data.main(["--out", str(tmp_path / name), "--corrupt", "4", "--per-class", "5"]) == 0
    a, b = (tmp_path / "a.zip").read_bytes(), (tmp_path / "b.zip").read_bytes()
    assert hashlib.sha256(a).hexdigest() == hashlib.sha256(b).hexdigest()
    with zipfile.ZipFile(tmp_path / "a.zip") as archive:
        names = archive.namelist()
        assert all(n.startswith("digits/") for n in names)
        pngs = [n for n in names if "/" in n and n.split("/")[-1][0].isdigit()]
        assert len(pngs) == 50 and {n.split("/")[1] for n in pngs} == {str(d) for d in range(10)}
        odd = sorted(n.split("/")[-1] for n in names if not n.split("/")[-1][0].isdigit())
        assert odd == ["broken_000.png", "empty_003.jpg", "garbage_001.png", "notes_002.txt"]
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        with Image.open(io.BytesIO(archive.read(pngs[0]))) as image:
            assert (image.format, image.size, image.mode) == ("PNG", (32, 32), "L")


def test_digits_generator_writes_each_digit_at_several_positions(tmp_path):
    """--shifts 3: each digit as itself (same name and bytes as without) and moved a pixel two ways."""
    digits_data.main(["--out", str(tmp_path / "one.zip"), "--per-class", "2"])
    digits_data.main(["--out", str(tmp_path / "three.zip"), "--per-class", "2", "--shifts", "3"])
    with zipfile.ZipFile(tmp_path / "one.zip") as one, zipfile.ZipFile(tmp_path / "three.zip") as three:
        originals = {n: one.read(n) for n in one.namelist()}
        shifted = {n: three.read(n) for n in three.namelist()}
    assert len(originals) == 20 and len(shifted) == 60
    assert {n: shifted[n] for n in originals} == originals
    assert len(set(shifted.values())) == 60  # every position is a different image
    assert sorted(n for n in shifted if n.startswith("digits/0/0_0000"))[1:] == [
        "digits/0/0_0000_s1.png",
        "digits/0/0_0000_s2.png",
    ]
    with pytest.raises(SystemExit):
        digits_data.main(["--out", str(tmp_path / "bad.zip"), "--shifts", "10"])


def test_dialogue_generator_is_deterministic_in_both_formats(tmp_path):
    for name in ("a.tsv", "b.tsv", "c.jsonl"):
        assert dialogue_data.main(["--out", str(tmp_path / name), "--categories", "greetings,numbers"]) == 0
    assert (tmp_path / "a.tsv").read_bytes() == (tmp_path / "b.tsv").read_bytes()
    header, *rows = [line.split("\t") for line in (tmp_path / "a.tsv").read_text().splitlines()]
    records = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert header == ["question", "response", "conversation"]
    assert len(rows) == len(records) > 40
    assert all(len(r) == 3 and all(r) for r in rows)
    assert [[r["question"], r["response"], r["conversation"]] for r in records] == rows
    # Every pair names its conversation (<category>-<number>); the trainer groups by it.
    conversations = {r[2] for r in rows}
    assert {c.rsplit("-", 1)[0] for c in conversations} == {"greetings", "numbers"}
    from trainer.dialogue.data import load_pairs

    for name in ("a.tsv", "c.jsonl"):
        loaded = load_pairs(tmp_path, data_file=name)
        assert loaded.pairs == [(q, r) for q, r, _ in rows] and len(set(loaded.groups)) == len(conversations)
    with pytest.raises(SystemExit):
        dialogue_data.main(["--out", str(tmp_path / "x.csv")])


def test_sample_data_generators_run_as_modules(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "include.sample_data.digits",
            "--out",
            str(tmp_path / "d.zip"),
            "--per-class",
            "2",
            "--classes",
            "3,7",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "4 images in 2 classes" in out.stdout
    with zipfile.ZipFile(tmp_path / "d.zip") as archive:
        assert sorted({n.split("/")[1] for n in archive.namelist()}) == ["3", "7"]


def test_the_process_ends_with_its_code_after_its_exit_handlers_and_buffered_output():
    """exit_process skips only the interpreter's teardown: the exit handlers (logging's flush among
    them) run, what sits in the streams' buffers reaches the pipe, and the exit code is the one given."""
    code = (
        "import atexit, logging, sys\n"
        "from trainer.common.cli import exit_process, setup_logging\n"
        "setup_logging()\n"
        "atexit.register(lambda: sys.stdout.write('exit handler ran\\n'))\n"
        "sys.stdout.write('a line still in the buffer')\n"
        "logging.getLogger('kubetrain.trainer').info('the last log line')\n"
        "exit_process(79)\n"
        "print('never')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 79, proc.stderr
    assert proc.stdout == "a line still in the bufferexit handler ran\n"
    assert proc.stderr.rstrip().endswith("INFO the last log line"), proc.stderr
