"""GPU step time of the image classifier's network: the framework's own training loop fed from
host memory against a compute-only loop on one device-resident batch, one step per call
against 16 fused into one call, float32 against mixed float16.

What runs: the classifier's network as ``trainer.image_classifier.model.build_model`` builds
it (the same Keras 3 layers, batch-norm momentum and float32 softmax), compiled with the
trainer's optimizer (Adam) and loss (sparse categorical cross-entropy), under Keras 3's JAX
backend. Why JAX: the lent GPU machines this figure was taken on have JAX with CUDA but no
TensorFlow and reach no package index; TensorFlow with its CUDA 12 libraries (about 2.5 GB)
cannot be carried there. The network, its sizes and the knobs are the trainer's; the loop
around them is Keras's, so the figures say what the GPU does with this network at these
sizes (how long a step takes, what feeding it from the host and calling it once per step
cost against the step, what float16 buys), not what TensorFlow's own dispatch costs. The
CPU figures of the trainer itself are bench_train_step's.

Loops, for each network and precision (each after its own warm-up, compile left out):

- ``compute-only, K=1``: ``model.train_step`` under ``jax.jit``, called once per step on one
  batch already on the GPU; the host only dispatches.
- ``compute-only, K=16``: 16 of those steps inside one compiled call (``jax.lax.scan``), what
  ``--steps-per-execution 16`` does in the trainer: one dispatch per 16 steps.
- ``fit, K=1`` and ``fit, K=16``: ``model.fit`` on uint8 images in host memory, shuffled
  every epoch, ``steps_per_execution`` 1 and 16: the host gathers, converts and copies each
  batch, as an input pipeline does. (Keras's JAX backend runs K steps as K compiled calls,
  so there K only spaces out the callbacks.)

Images are random pixels (never zeros) and labels random classes: the step time does not
depend on what the pixels show.

Run: KERAS_BACKEND=jax python bench/bench_gpu_step.py (or ``make bench BENCH=gpu_step``, which
skips it without a GPU and JAX, leaving the last results in place). Writes
bench/results/gpu_step.md and, with --jsonl, one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULT = REPO / "bench" / "results" / "gpu_step.md"
COMMAND = "KERAS_BACKEND=jax python bench/bench_gpu_step.py"
CLASSES = 10
FUSED = 16
# name -> (ClassifierConfig fields, steps per timed epoch); in order of priority (a time budget
# skips the last ones). Short steps get more of them, so that an epoch's end is a small share.
CASES = {
    "digits demo (CNN 32x32, batch 64)": ({"model": "cnn", "image_size": 32, "batch_size": 64}, 256),
    "MobileNetV2 224x224, batch 128": ({"model": "mobilenet_v2", "image_size": 224, "batch_size": 128}, 64),
    "CNN 64x64, batch 256": ({"model": "cnn", "image_size": 64, "batch_size": 256}, 128),
}
PRECISIONS = {"float32": "float32", "mixed float16": "mixed_float16"}
SMOKE = {
    "smoke: CNN 16x16, batch 8": ({"model": "cnn", "image_size": 16, "batch_size": 8, "filters": 4}, 32),
    "smoke: MobileNetV2 32x32, batch 4": (
        {"model": "mobilenet_v2", "image_size": 32, "batch_size": 4, "alpha": 0.35},
        16,
    ),
}


def machine() -> dict:
    import jax
    import keras

    info = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "devices": [f"{d.platform}:{getattr(d, 'device_kind', d)}" for d in jax.devices()],
        "cpus": os.cpu_count(),
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"not available ({exc})"
    return info


def build(fields: dict, policy: str, steps_per_epoch: int, k: int):
    """The trainer's network, optimizer and loss, compiled with XLA."""
    import keras

    from trainer.image_classifier.config import ClassifierConfig
    from trainer.image_classifier.model import build_model

    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    config = ClassifierConfig(data_dir="/data", checkpoint_dir="/checkpoints", output_dir="/output", **fields)
    model = build_model(config, CLASSES, steps_per_epoch=steps_per_epoch)
    model.compile(
        optimizer=keras.optimizers.Adam(config.learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        steps_per_execution=k,
        jit_compile=True,
    )
    return model


def data(fields: dict, steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    n = fields["batch_size"] * steps
    size = fields["image_size"]
    images = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
    labels = rng.integers(0, CLASSES, size=(n,), dtype=np.int32)
    return images, labels


def compute_only(model, images, labels, batch: int, steps: int, repeats: int) -> dict[int, float]:
    """Seconds per step of the compiled train step on one device-resident batch, K=1 and K=16."""
    import jax

    # One real step through fit builds the optimizer and metric variables.
    model.fit(images[:batch], labels[:batch], batch_size=batch, epochs=1, verbose=0)
    # Copies: the loops donate their state, and fit goes on with the model's own variables.
    state = tuple(
        [jax.numpy.copy(v.value) for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    x = jax.device_put(images[:batch])  # uint8, as fit feeds them: the same compiled step
    y = jax.device_put(labels[:batch])

    one = jax.jit(lambda s, x, y: model.train_step(s, (x, y))[1], donate_argnums=0)

    def fused_steps(s, x, y):
        return jax.lax.scan(lambda c, _: (model.train_step(c, (x, y))[1], None), s, None, length=FUSED)[0]

    fused = jax.jit(fused_steps, donate_argnums=0)
    result = {}
    for k, fn in ((1, one), (FUSED, fused)):
        calls = max(1, steps // k)
        for _ in range(2):  # warm-up: compile and first runs
            state = fn(state, x, y)
        jax.block_until_ready(state)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                state = fn(state, x, y)
            jax.block_until_ready(state)
            times.append((time.perf_counter() - start) / (calls * k))
        result[k] = statistics.median(times)
    return result


def fit_loop(model, images, labels, batch: int, repeats: int) -> float:
    """Seconds per step of model.fit over host-memory images, the first epoch (compile) left out."""
    import keras

    steps = len(images) // batch
    epoch_times: list[float] = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):  # logs are host floats here: the epoch has finished
            epoch_times.append(time.perf_counter() - self.start)

    model.fit(images, labels, batch_size=batch, epochs=1 + repeats, verbose=0, callbacks=[EpochTimer()])
    return statistics.median(epoch_times[1:]) / steps


def run_case(name: str, fields: dict, precision: str, steps: int, repeats: int) -> list[dict]:
    batch = fields["batch_size"]
    images, labels = data(fields, steps)
    rows = []
    began = time.monotonic()
    model = build(fields, PRECISIONS[precision], steps, 1)
    per_step = compute_only(model, images, labels, batch, steps, repeats)
    for k in (1, FUSED):
        rows.append(
            {"case": name, "precision": precision, "loop": "compute-only", "k": k, "step_s": per_step[k]}
        )
    for k in (1, FUSED):
        # The same model and compiled step: K only changes how fit groups the calls.
        model.steps_per_execution = k
        model.make_train_function(force=True)
        step = fit_loop(model, images, labels, batch, repeats)
        rows.append(
            {"case": name, "precision": precision, "loop": "fit (host input)", "k": k, "step_s": step}
        )
    for row in rows:
        row["examples_per_s"] = batch / row["step_s"]
        row["batch"] = batch
    print(f"   {name}, {precision}: {time.monotonic() - began:.0f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| case | precision | loop | K | step time (ms) | examples/s | vs compute-only K=16 | float32's time / this |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    floor = {
        (r["case"], r["precision"]): r["step_s"]
        for r in rows
        if r["loop"] == "compute-only" and r["k"] == FUSED
    }
    fp32 = {(r["case"], r["loop"], r["k"]): r["step_s"] for r in rows if r["precision"] == "float32"}
    for r in rows:
        base = floor.get((r["case"], r["precision"]))
        ref = fp32.get((r["case"], r["loop"], r["k"]))
        vs_floor = f"{r['step_s'] / base:.2f}x" if base else "-"
        vs_fp32 = f"{ref / r['step_s']:.2f}x" if ref and r["precision"] != "float32" else "-"
        lines.append(
            f"| {r['case']} | {r['precision']} | {r['loop']} | {r['k']} | {1000 * r['step_s']:.2f} "
            f"| {r['examples_per_s']:,.0f} | {vs_floor} | {vs_fp32} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, help="steps per timed epoch and compute-only repeat (default: the case's)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs / repeats; the median is kept")
    parser.add_argument(
        "--budget", type=float, default=420, help="seconds; cases not begun by then are skipped"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any device (checks the script)")
    parser.add_argument("--jsonl", type=Path, help="also write the rows here, one JSON object per line")
    parser.add_argument("--result", type=Path, default=RESULT)
    args = parser.parse_args()

    try:
        import jax
    except ImportError:
        print("gpu_step: skipped: needs JAX (see the module's docstring); the last results stay", flush=True)
        return 0
    if not args.smoke and not any(d.platform == "gpu" for d in jax.devices()):
        print(f"gpu_step: skipped: no GPU ({jax.devices()}); the last results stay", flush=True)
        return 0

    # Identical programs (the step compiled for fit and for the compute-only loop) compile once.
    jax.config.update(
        "jax_compilation_cache_dir", str(Path(os.environ.get("TMPDIR", "/tmp")) / "gpu-step-xla")
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    started = time.monotonic()
    info = machine()
    print(json.dumps(info), flush=True)
    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    skipped = []
    for name, (fields, steps) in (SMOKE if args.smoke else CASES).items():
        for precision in PRECISIONS:
            if time.monotonic() - started > args.budget:
                skipped.append(f"{name}, {precision}")
                continue
            case_rows = run_case(name, fields, precision, args.steps or steps, args.repeats)
            rows.extend(case_rows)
            if args.jsonl:
                with args.jsonl.open("a") as fh:
                    for row in case_rows:
                        fh.write(json.dumps(row) + "\n")
    load_after = os.getloadavg()[0]
    text = table(rows)
    print(text, flush=True)
    if args.smoke:
        return 0
    lines = [
        f"Command: `{COMMAND}` (repeats {args.repeats}); "
        f"{time.monotonic() - started:.0f} s in all, compiles included.",
        "",
        f"Machine: {info['nvidia_smi']}; {info['cpus']} CPUs; Python {info['python']}, JAX {info['jax']}, "
        f"Keras {info['keras']} ({info['backend']} backend); load average {load_before:.1f} before, "
        f"{load_after:.1f} after.",
        "",
        "Each step time is the median of the repeats, after a warm-up that compiles. "
        "'vs compute-only K=16': the row's step time over the fused compute-only loop's, same case and "
        "precision (1.00x: nothing but the GPU's work). "
        "'float32's time / this': above 1.00x, mixed float16 is faster in the same loop.",
        "",
        text,
    ]
    if skipped:
        lines += ["", f"Not run (time budget of {args.budget:.0f} s spent): {'; '.join(skipped)}."]
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.result}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
