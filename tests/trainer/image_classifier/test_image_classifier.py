"""The image classifier on real generated digits: contract outputs, accuracy, resume, refusals."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from include.sample_data import digits as digits_data
from trainer.common.contract import EXIT_DATAERR, EXIT_NOINPUT, EXIT_PREEMPTED, EXIT_USAGE
from trainer.common.export import latest_saved_model
from trainer.image_classifier import data as image_data
from trainer.image_classifier import model as image_model
from trainer.image_classifier import train as image_classifier
from trainer.image_classifier.prepare import prepare_images

REPO = Path(__file__).resolve().parents[3]
STEP_LINE = re.compile(r"INFO step (\d+) epoch \d+/\d+ batch \d+/\d+ loss ([0-9.]+)")
SMALL = ["--image-size", "32", "--batch-size", "32"]
# Keras converts tensors with np.array(x) internally, which NumPy 2 flags on every call.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def extract(zip_path: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(dest)
    return dest


@pytest.fixture(scope="module")
def digits_zip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("digits") / "digits.zip"
    digits_data.main(["--out", str(path), "--corrupt", "4"])
    return path


@pytest.fixture(scope="module")
def small_zip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("digits") / "small.zip"
    digits_data.main(["--out", str(path), "--corrupt", "4", "--per-class", "12"])
    return path


def trainer_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "CHECKPOINT_DIR", "OUTPUT_DIR")}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def run_classifier(
    args: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.image_classifier", *args],
        cwd=REPO,
        env=env or trainer_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dirs(tmp_path: Path, data: Path) -> list[str]:
    return [
        "--data-dir",
        str(data),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--output-dir",
        str(tmp_path / "out"),
    ]


def step_losses(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(log)}


@pytest.mark.slow
def test_trains_on_digits_and_writes_the_contract_files(tmp_path, digits_zip):
    data = extract(digits_zip, tmp_path / "data")  # digits/<class>/...: one top-level folder
    out = tmp_path / "out"
    env = trainer_env(
        DATA_DIR=str(data),
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        OUTPUT_DIR=str(out),
        KUBETRAIN_DATASET_VERSION="3f2a9c0d1e4b5a69",
        KUBETRAIN_IMAGE="registry.local/kubetrain:abc",
        KUBETRAIN_CODE_VERSION="abc123",
    )
    proc = run_classifier([*SMALL, "--epochs", "2", "--checkpoint-every-steps", "30"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped 4 file(s) that are not readable images" in proc.stderr
    assert "devices: /physical_device:CPU:0" in proc.stderr
    # Every step line says how much training is left, at the step time so far.
    etas = [
        int(m) * 60 + int(s)
        for m, s in re.findall(r"examples/s [0-9.]+ input wait [^\n]*? eta (\d+)m(\d\d)s$", proc.stderr, re.M)
    ]
    assert len(etas) == len(step_losses(proc.stderr)) > 2 and etas[-1] <= etas[0], etas

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["trainer"] == "image_classifier" and metrics["task"] == "classification"
    assert metrics["skipped_files"] == 4
    assert metrics["final"]["val_accuracy"] > 0.5, metrics  # ten classes: chance is 0.1
    assert metrics["epochs"] == 2 and metrics["steps"] == 2 * (metrics["train_examples"] // 32)
    assert metrics["train_examples"] + metrics["val_examples"] == 1797
    assert metrics["best"]["val_accuracy"] >= metrics["final"]["val_accuracy"]
    assert metrics["devices"] == ["/physical_device:CPU:0"] and metrics["examples_per_s"] > 0
    assert metrics["resumed_from_step"] == 0 and metrics["wall_time_s"] > 0

    with open(out / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "epoch",
        "step",
        "loss",
        "accuracy",
        "val_loss",
        "val_accuracy",
        "learning_rate",
        "wall_time_s",
    ]
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert int(rows[-1]["step"]) == metrics["steps"]
    assert float(rows[1]["loss"]) < float(rows[0]["loss"])
    best = max(rows, key=lambda r: float(r["val_accuracy"]))
    assert (
        abs(float(best["val_accuracy"]) - metrics["final"]["val_accuracy"]) < 1e-5
    )  # "final": the exported model
    assert metrics["best"]["epoch"] == int(best["epoch"]) == metrics["exported"]["epoch"]
    assert abs(float(rows[-1]["val_accuracy"]) - metrics["last"]["val_accuracy"]) < 1e-5
    assert metrics["input_wait_s"] >= 0 and metrics["compute_s"] > 0 and metrics["step_time_s"] > 0
    assert metrics["steps_per_execution"] == 1 and metrics["jit_compile"] is False
    assert {p.name for p in (out / "tensorboard").iterdir()} == {"train", "validation"}

    params = json.loads((out / "params.json").read_text())
    assert params["dataset_version"] == "3f2a9c0d1e4b5a69"
    assert params["image"] == "registry.local/kubetrain:abc" and params["code_version"] == "abc123"
    assert params["hyperparameters"]["image_size"] == 32 and params["hyperparameters"]["epochs"] == 2
    assert params["classes"] == [str(d) for d in range(10)]

    confusion = json.loads((out / "confusion_matrix.json").read_text())
    matrix = confusion["matrix"]
    assert (
        confusion["classes"] == params["classes"] and len(matrix) == 10 and all(len(r) == 10 for r in matrix)
    )
    assert sum(map(sum, matrix)) == metrics["val_examples"]
    correct = sum(matrix[i][i] for i in range(10))
    assert abs(correct / metrics["val_examples"] - metrics["final"]["val_accuracy"]) < 1e-6

    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["step"] == metrics["steps"] and state["epoch"] == 2 and len(state["history"]) == 2
    assert (tmp_path / "ckpt" / f"ckpt-{metrics['steps']}.index").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "temporary files left in OUTPUT_DIR"

    # model.keras and the SavedModel hold the best epoch's weights: on the run's validation split
    # (the same seeded split, the same decoding) both score the best epoch's val_accuracy.
    import keras
    import numpy as np
    import tensorflow as tf

    config = image_classifier.ClassifierConfig(
        data_dir=str(data),
        checkpoint_dir=str(tmp_path / "c"),
        output_dir=str(tmp_path / "o"),
        image_size=32,
        batch_size=32,
    )
    folder = prepare_images(data, config)
    train_files, val_files = image_data.split_files(folder.files, config.validation_split, config.seed)
    val = image_data.ImagePipeline(folder, train_files, val_files, config).val_dataset()
    model = keras.saving.load_model(out / "model.keras")
    # keep a reference: it owns the variables
    loaded = tf.saved_model.load(str(latest_saved_model(out / "saved_model")))
    hits = {"keras": 0, "saved_model": 0}
    for x, y in val:
        probs = np.asarray(model(x))
        served = np.asarray(loaded.serve_pixels(tf.cast(x, tf.uint8))["probabilities"])
        assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-3) and np.abs(probs - served).max() < 1e-4
        hits["keras"] += int((probs.argmax(1) == y.numpy()).sum())
        hits["saved_model"] += int((served.argmax(1) == y.numpy()).sum())
    for name, correct in hits.items():
        assert correct / len(val_files) == pytest.approx(metrics["best"]["val_accuracy"], abs=1e-9), name


@pytest.mark.slow
def test_validation_keeps_up_with_training_on_few_steps_an_epoch(tmp_path, digits_zip):
    # 1,438 training images at batch size 128: 11 steps an epoch. With the batch-norm momentum
    # of a long run the moving statistics still describe the first weights: at 0.9, epoch 2
    # trained to an accuracy of 0.93 and validated at 0.30.
    data = extract(digits_zip, tmp_path / "data")
    proc = run_classifier(
        [
            *dirs(tmp_path, data),
            "--image-size",
            "24",
            "--batch-size",
            "128",
            "--epochs",
            "2",
            "--learning-rate",
            "0.01",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "batch norm momentum 0.6364: moving statistics over about 25% of an epoch's 11 steps" in proc.stderr
    )
    with open(tmp_path / "out" / "history.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["accuracy"]) > 0.8, last
    # stale statistics validate far under training (0.30 against 0.93); a sound run within a few points,
    # how many depending on the order the epoch's images came in (0.82 against 0.93 from the prepared shards)
    assert float(last["val_accuracy"]) > float(last["accuracy"]) - 0.15, last


@pytest.mark.parametrize(
    ("steps", "momentum"), [(1, 0.5), (8, 0.5), (11, 0.6364), (44, 0.9091), (400, 0.99), (100_000, 0.99)]
)
def test_batch_norm_momentum_spans_a_quarter_of_an_epoch(steps, momentum):
    assert image_model.batch_norm_momentum(steps) == momentum


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_the_rerun_resumes(tmp_path, digits_zip, caplog):
    data = extract(digits_zip, tmp_path / "data")
    args = [
        *dirs(tmp_path, data),
        *SMALL,
        "--epochs",
        "40",
        "--checkpoint-every-steps",
        "15",
        "--log-every-steps",
        "1",
    ]
    log_path = tmp_path / "first.log"
    state_file = tmp_path / "ckpt" / "trainer_state.json"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.image_classifier", *args],
            cwd=REPO,
            env=trainer_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if state_file.exists() and json.loads(state_file.read_text())["step"] >= 30:
                break
            time.sleep(0.1)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == EXIT_PREEMPTED
    finally:
        if proc.poll() is None:
            proc.kill()
    first = log_path.read_text()
    saved = json.loads(state_file.read_text())
    saved_step = saved["step"]
    assert f"checkpoint ckpt-{saved_step} written (SIGTERM" in first
    before = step_losses(first)
    assert max(before) == saved_step >= 30
    assert (tmp_path / "ckpt" / f"ckpt-{saved_step}.index").exists()

    proc = run_classifier([*args, "--max-steps", str(saved_step + 8)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from ckpt-{saved_step}: step {saved_step}" in proc.stderr
    after = step_losses(proc.stderr)
    assert min(after) == saved_step + 1 and max(after) == saved_step + 8

    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == saved_step and metrics["steps"] == saved_step + 8
    # The loss curve continues: the first resumed losses sit near the last ones before the
    # kill, far below the loss of the untrained model.
    initial = sum(before[s] for s in (1, 2, 3)) / 3
    last_before = sum(before[s] for s in range(saved_step - 4, saved_step + 1)) / 5
    first_after = sum(after[s] for s in range(saved_step + 1, saved_step + 6)) / 5
    assert initial - last_before > 0.6, (initial, last_before)
    assert abs(first_after - last_before) < 0.35 * (initial - last_before), (
        initial,
        last_before,
        first_after,
    )

    with open(tmp_path / "out" / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == list(range(1, len(rows) + 1))
    assert [r for r in rows if int(r["epoch"]) <= saved["epoch"]] == [
        {k: _csv(v) for k, v in row.items()} for row in saved["history"]
    ]
    assert int(rows[-1]["step"]) == saved_step + 8

    # A retried task after the end writes the outputs again without training; a checkpoint
    # from another architecture is refused, naming what changed.
    (tmp_path / "out" / "metrics.json").unlink()
    assert image_classifier.main([*args, "--max-steps", str(saved_step + 8)]) == 0
    again = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert again["steps"] == saved_step + 8 and again["final"] == metrics["final"]
    assert image_classifier.main([*args, "--filters", "16"]) == EXIT_USAGE
    assert "does not fit this model" in caplog.text and "filters: 32 -> 16" in caplog.text


def _csv(value):
    return f"{value:.6g}" if isinstance(value, float) else str(value)


@pytest.mark.slow
def test_flat_layout_mirrored_over_two_devices_with_mixed_precision(tmp_path, small_zip):
    extracted = extract(small_zip, tmp_path / "x")
    data = tmp_path / "data"
    shutil.move(extracted / "digits", data)  # class folders directly in DATA_DIR
    proc = run_classifier(
        [
            *dirs(tmp_path, data),
            *SMALL,
            "--max-steps",
            "3",
            "--virtual-cpus",
            "2",
            "--precision=mixed_float16",
            "--augment",
            "--flip",
            "--log-every-steps",
            "1",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy MirroredStrategy with 2 replica(s)" in proc.stderr and "mixed_float16" in proc.stderr
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["replicas"] == 2 and metrics["mixed_precision"] is True
    assert metrics["steps"] == 3 and metrics["skipped_files"] == 4 and len(metrics["classes"]) == 10
    with open(tmp_path / "out" / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["step"] == "3"  # 100 training images: three steps make one epoch
    assert all(0 < loss < 10 for loss in step_losses(proc.stderr).values())


@pytest.mark.slow
def test_mobilenet_uses_only_local_weights(tmp_path, small_zip):
    import keras
    import numpy as np

    data = extract(small_zip, tmp_path / "data")
    weights = tmp_path / "mobilenet_v2_0.35_notop.weights.h5"
    spec = {"input_shape": (32, 32, 3), "include_top": False, "alpha": 0.35, "pooling": "avg"}
    keras.applications.MobileNetV2(weights=None, **spec).save_weights(weights)
    proc = run_classifier(
        [
            *dirs(tmp_path, data),
            *SMALL,
            "--model",
            "mobilenet_v2",
            "--alpha",
            "0.35",
            "--max-steps",
            "2",
            "--weights",
            str(weights),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"MobileNetV2 starts from the local weights file {weights}" in proc.stderr
    model = keras.saving.load_model(tmp_path / "out" / "model.keras")
    base = next(layer for layer in model.layers if layer.name.startswith("mobilenetv2"))
    reference = keras.applications.MobileNetV2(weights=str(weights), **spec)
    assert len(base.weights) == len(reference.weights) > 100
    # A frozen base leaves the loaded weights (batch-norm statistics included) untouched.
    assert all(np.array_equal(a, b) for a, b in zip(base.get_weights(), reference.get_weights(), strict=True))
    head = model.get_layer("probabilities").get_weights()[0]
    assert head.shape == (base.output.shape[-1], 10)


def test_files_tensorflow_cannot_decode_are_skipped_and_counted(tmp_path, caplog, small_zip):
    from PIL import Image

    caplog.set_level(logging.INFO)
    data = extract(small_zip, tmp_path / "data")
    seven = data / "digits" / "7"
    # Pillow reads 1-bit BMPs; TensorFlow's BMP decoder refuses them. The name puts it in
    # the validation split (seed 42, 0.2), whose example count must leave it out: the split
    # permutes each class's files in name order, so the name picks the BMP's position.
    for n in range(13):
        bmp = seven / f"7_{n * 10:04d}_one_bit.bmp"
        Image.open(next(seven.glob("*.png"))).convert("1").save(bmp)
        config = image_classifier.ClassifierConfig(
            data_dir=str(data),
            checkpoint_dir=str(tmp_path / "c"),
            output_dir=str(tmp_path / "o"),
            image_size=16,
        )
        folder = prepare_images(data, config, tmp_path / f"split-{n}", environ={})
        train_files, val_files = image_data.split_files(folder.files, 0.2, 42)
        if str(bmp) in {path for path, _ in val_files}:
            break
        bmp.unlink()
    else:
        pytest.fail("no file name put the BMP in the validation split")
    rc = image_classifier.main(
        [
            *dirs(tmp_path, data),
            "--image-size",
            "16",
            "--batch-size",
            "16",
            "--max-steps",
            "2",
            "--log-every-steps",
            "100",
        ]
    )
    assert rc == 0, caplog.text[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["undecodable_files"] == 1
    assert metrics["skipped_files"] == 4 + 1  # the generator's four broken files, and the BMP
    assert (
        f"TensorFlow could not decode 1 file(s) that Pillow read; they were left out: 7/{bmp.name}"
        in caplog.text
    )
    # Only the images that validated count, as the confusion matrix does.
    assert metrics["val_examples"] == len(val_files) - 1
    assert metrics["train_examples"] == len(train_files)
    matrix = json.loads((tmp_path / "out" / "confusion_matrix.json").read_text())["matrix"]
    assert sum(map(sum, matrix)) == metrics["val_examples"]


def test_a_changed_learning_rate_is_used_on_resume(tmp_path, caplog, small_zip):
    import numpy as np
    import tensorflow as tf

    caplog.set_level(logging.INFO)
    data = extract(small_zip, tmp_path / "data")
    args = [*dirs(tmp_path, data), "--image-size", "16", "--batch-size", "16", "--log-every-steps", "100"]
    assert image_classifier.main([*args, "--max-steps", "2"]) == 0, caplog.text[-3000:]
    caplog.clear()
    assert image_classifier.main([*args, "--max-steps", "4", "--learning-rate", "0.0005"]) == 0, caplog.text[
        -3000:
    ]
    assert "resuming with changed settings: learning_rate: 0.001 -> 0.0005" in caplog.text
    assert "learning rate 0.0005 from this run's settings replaces the checkpoint's 0.001" in caplog.text
    assert (
        "resumed from ckpt-2: step 2, epoch 1, batch 2 of 6 in that epoch; learning rate 0.0005"
        in caplog.text
    )
    params = json.loads((tmp_path / "out" / "params.json").read_text())
    assert params["hyperparameters"]["learning_rate"] == 0.0005
    # The learning rate in effect: the history row after the resume, and the optimizer's
    # variable in the checkpoint it wrote.
    with open(tmp_path / "out" / "history.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    assert last["step"] == "4" and float(last["learning_rate"]) == 0.0005
    reader = tf.train.load_checkpoint(str(tmp_path / "ckpt" / "ckpt-4"))
    name = next(
        n for n in reader.get_variable_to_shape_map() if n.startswith("optimizer/") and "learning_rate" in n
    )
    assert reader.get_tensor(name) == np.float32(0.0005)


def test_deterministic_runs_repeat_bit_for_bit(tmp_path, small_zip):
    import numpy as np

    data = extract(small_zip, tmp_path / "data")
    results = []
    for run in ("a", "b"):
        args = [
            "--data-dir",
            str(data),
            "--checkpoint-dir",
            str(tmp_path / run / "ckpt"),
            "--output-dir",
            str(tmp_path / run / "out"),
            "--image-size",
            "16",
            "--batch-size",
            "16",
            "--epochs",
            "2",
            "--augment",
            "--deterministic",
            "--steps-per-execution",
            "4",
            "--log-every-steps",
            "100",
        ]
        proc = run_classifier(args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "; deterministic ops" in proc.stderr
        metrics = json.loads((tmp_path / run / "out" / "metrics.json").read_text())
        assert metrics["deterministic"] is True and metrics["steps_per_execution"] == 4
        assert metrics["input_wait_s"] is None  # TensorFlow refuses its timestamp op under op determinism
        results.append((metrics, (tmp_path / run / "out" / "history.csv").read_text()))
    (first, history_a), (second, history_b) = results
    assert first["final"] == second["final"] and first["last"] == second["last"]
    strip = [line.rsplit(",", 1)[0] for line in history_a.splitlines()]  # all but wall_time_s
    assert strip == [line.rsplit(",", 1)[0] for line in history_b.splitlines()]
    import tensorflow as tf

    a, b = (tf.train.load_checkpoint(str(tmp_path / run / "ckpt" / f"ckpt-{first['steps']}")) for run in "ab")
    for name in a.get_variable_to_shape_map():
        if "trainer_state" not in name and "save_counter" not in name:
            assert np.array_equal(a.get_tensor(name), b.get_tensor(name)), name


def test_mobilenet_without_weights_starts_from_random_weights(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    config = image_classifier.ClassifierConfig(
        data_dir="d", checkpoint_dir="c", output_dir="o", model="mobilenet_v2", alpha=0.35, image_size=32
    )
    model = image_model.build_model(config, num_classes=4, steps_per_epoch=20)
    assert (
        "no --weights given: MobileNetV2 starts from random weights (weights are never downloaded)"
        in caplog.text
    )
    assert model.output.shape == (None, 4) and model.count_params() > 400_000
    # Random weights: every batch-norm layer averages over a quarter of the epoch, not MobileNetV2's 0.999.
    import keras

    norms = [
        layer
        for layer in model.get_layer("mobilenetv2_0.35_32").layers
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    assert norms and {layer.momentum for layer in norms} == {0.8}


# -- refusals before the first training step (in-process: no TensorFlow is loaded) ------


def _make_single_class(root: Path) -> Path:
    data = root / "single"
    digits_data.main(["--out", str(root / "one.zip"), "--classes", "3", "--per-class", "10"])
    return extract(root / "one.zip", data)


def _make_all_corrupt(root: Path) -> Path:
    data = root / "broken"
    for label in ("a", "b"):
        (data / label).mkdir(parents=True)
        (data / label / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
        (data / label / "y.jpg").write_text("not a jpeg")
    return data


@pytest.mark.parametrize(
    ("make", "code", "message"),
    [
        (
            lambda root: (root / "empty").mkdir() or root / "empty",
            EXIT_DATAERR,
            "no class folders in DATA_DIR '{data}': expected one sub-folder per class",
        ),
        (_make_single_class, EXIT_DATAERR, "only one class ('3') has readable images in DATA_DIR '{data}'"),
        (_make_all_corrupt, EXIT_DATAERR, "no readable images in DATA_DIR '{data}' (4 file(s) skipped)"),
        (lambda root: root / "missing", EXIT_NOINPUT, "DATA_DIR '{data}' does not exist"),
        (
            lambda root: (root / "file").write_text("x") and root / "file",
            EXIT_NOINPUT,
            "DATA_DIR '{data}' is not a directory",
        ),
    ],
    ids=["empty", "single-class", "all-corrupt", "missing", "not-a-directory"],
)
def test_bad_data_is_refused_before_training(tmp_path, caplog, make, code, message):
    data = make(tmp_path)
    caplog.set_level(logging.INFO)
    rc = image_classifier.main([*dirs(tmp_path, data), *SMALL])
    assert rc == code
    assert message.format(data=data) in caplog.text
    assert not (tmp_path / "out" / "metrics.json").exists()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_bad_flag_is_refused_with_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        image_classifier.main([*dirs(tmp_path, tmp_path), "--image-size", "4"])
    assert info.value.code == 2
    assert "--image-size must be an integer from 8 to 1024, got 4" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_split_is_seeded_and_stratified():
    files = [(f"{label}/{i}.png", label) for label in range(3) for i in range(10)]
    train_a, val_a = image_data.split_files(files, 0.2, seed=1)
    train_b, val_b = image_data.split_files(files, 0.2, seed=1)
    _, val_c = image_data.split_files(files, 0.2, seed=2)
    assert (train_a, val_a) == (train_b, val_b) and val_a != val_c
    assert sorted(label for _, label in val_a) == [0, 0, 1, 1, 2, 2]
    assert sorted(train_a + val_a) == sorted(files)
