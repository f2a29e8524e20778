"""Training step time of the image classifier: steps per execution 1 vs 16, XLA off and on, and what
``--deterministic`` costs.

Each configuration trains the real trainer (``python -m trainer.image_classifier``) in a
fresh process on the generated digits dataset, and the figures come from the run's own
metrics.json: the mean wall time per step and examples/s in steady state (the first call,
which traces and compiles, is left out; input wait is included), and the share of that
time spent waiting for input. Configurations alternate within each round, so that all
see the same machine load; the table gives the median over the rounds.

Two cases: the digits demo's own settings (the CNN at 32x32, batch 64), and a small
step (8 filters at 16x16, batch 16) where the fixed cost of each call into TensorFlow is
a larger share of the step: the cost that ``--steps-per-execution`` spreads over K steps.

Run: trainer/.venv/bin/python bench/bench_train_step.py [--rounds N]
(or ``make bench BENCH=train_step``). Writes bench/results/train_step.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from include.sample_data import digits as digits_data  # noqa: E402

RESULT = REPO / "bench" / "results" / "train_step.md"
COMMAND = "trainer/.venv/bin/python bench/bench_train_step.py"
CASES = {
    "digits demo (CNN 32x32, batch 64)": ["--image-size", "32", "--batch-size", "64", "--epochs", "4"],
    "small step (CNN 8 filters, 16x16, batch 16)": [
        "--image-size",
        "16",
        "--filters",
        "8",
        "--batch-size",
        "16",
        "--epochs",
        "2",
    ],
}
# (steps per execution, XLA, --deterministic)
CONFIGS = [(1, False, False), (16, False, False), (1, True, False), (16, True, False), (1, False, True)]


def train(data: Path, work: Path, case: list[str], k: int, jit: bool, deterministic: bool) -> dict:
    out = work / f"out-{k}-{int(jit)}-{int(deterministic)}"
    args = [
        sys.executable,
        "-m",
        "trainer.image_classifier",
        "--data-dir",
        str(data),
        "--checkpoint-dir",
        str(work / f"ckpt-{time.monotonic_ns()}"),
        "--output-dir",
        str(out),
        *case,
        "--steps-per-execution",
        str(k),
        "--jit-compile" if jit else "--no-jit-compile",
        "--deterministic" if deterministic else "--no-deterministic",
        "--log-every-steps",
        "100000",
        "--checkpoint-every-steps",
        "0",
        "--no-tensorboard",
    ]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"trainer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((out / "metrics.json").read_text())


def median_run(runs: list[dict]) -> dict:
    """The run whose step time is the median (the lower middle one of an even count)."""
    return sorted(runs, key=lambda m: m["step_time_s"])[(len(runs) - 1) // 2]


def percent(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of every configuration (default: 3)")
    rounds = parser.parse_args().rounds
    runs: dict[tuple[str, int, bool, bool], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        root = Path(tmp)
        digits_data.main(["--out", str(root / "digits.zip")])
        with zipfile.ZipFile(root / "digits.zip") as z:
            z.extractall(root / "data")
        for round_ in range(rounds):
            for name, case in CASES.items():
                for k, jit, det in CONFIGS:
                    metrics = train(root / "data", root, case, k, jit, det)
                    runs.setdefault((name, k, jit, det), []).append(metrics)
                    print(
                        f"round {round_ + 1}/{rounds} {name} K={k} jit={jit} deterministic={det}: "
                        f"{metrics['step_time_s'] * 1000:.2f} ms/step, {metrics['examples_per_s']:.0f} examples/s, "
                        f"input wait {percent(metrics['input_wait_fraction'])}",
                        flush=True,
                    )
    load = os.getloadavg()[0]
    import tensorflow as tf

    lines = [
        f"Command: `{COMMAND} --rounds {rounds}`",
        "",
        "**CPU only**: this machine has no GPU, so every figure below is a CPU figure. On a GPU the",
        "fixed cost per call is a larger share of a (much shorter) step; measure there before",
        "choosing K.",
        "",
        f"Machine: {os.cpu_count()} CPU(s), {platform.machine()}, TensorFlow {tf.__version__}; load average "
        f"{load:.1f} at the end (other work shared the cores). Each row is the run with the median step time of "
        f"{rounds} round(s); each run is a fresh "
        "trainer process on the 1,797 generated digits (1,438 for training), figures from its metrics.json "
        "(steady state: the first call, with tracing and XLA compilation, left out; input wait included).",
        "",
        "| case | steps per execution | XLA | deterministic | step time (ms) | spread over the rounds (ms) "
        "| examples/s | input wait | vs K=1, no XLA |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in CASES:
        base = median_run(runs[(name, 1, False, False)])["step_time_s"]
        for k, jit, det in CONFIGS:
            # The run with the median step time gives the whole row, so that its figures belong together.
            median = median_run(runs[(name, k, jit, det)])
            step, rate, wait = (
                median["step_time_s"],
                median["examples_per_s"],
                percent(median["input_wait_fraction"]),
            )
            times = [m["step_time_s"] * 1000 for m in runs[(name, k, jit, det)]]
            lines.append(
                f"| {name} | {k} | {'on' if jit else 'off'} | {'on' if det else 'off'} | "
                f"{step * 1000:.2f} | {min(times):.2f}-{max(times):.2f} | {rate:,.0f} | {wait} | "
                f"{base / step:.2f}x |"
            )
    lines += [
        "",
        "vs K=1, no XLA: the step time of K=1 without XLA (and without --deterministic) divided by this "
        "row's (above 1: faster). Input wait is not measured under --deterministic (TensorFlow refuses its "
        "timestamp op when op determinism is on).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
