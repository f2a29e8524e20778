"""Parse time of each DAG file over the bare Airflow import (target: < 0.5 s each).

Each measurement is a fresh interpreter that first imports ``airflow.sdk`` (the bare
cost every DAG file pays) and then executes one DAG file; we report the median extra
time of the DAG file over 5 runs, and the Airflow import itself for scale.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = 5
TARGET_S = 0.5

PROBE = r"""
import importlib.util, json, sys, time
t0 = time.perf_counter()
import airflow.sdk  # noqa: F401
t1 = time.perf_counter()
spec = importlib.util.spec_from_file_location("dagfile", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
t2 = time.perf_counter()
print(json.dumps({"airflow": t1 - t0, "dag": t2 - t1}))
"""


def measure(path: Path) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins")}
    base, extra = [], []
    for _ in range(RUNS):
        out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, env=env, cwd=REPO)
        if out.returncode:
            raise SystemExit(f"{path.name} failed to parse:\n{out.stderr[-2000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        base.append(result["airflow"])
        extra.append(result["dag"])
    return statistics.median(base), statistics.median(extra)


def main() -> int:
    files = sorted(p for p in (REPO / "dags").glob("*.py") if not p.name.startswith("_"))
    rows, worst = [], 0.0
    for path in files:
        base, extra = measure(path)
        worst = max(worst, extra)
        rows.append(f"| {path.name} | {extra:.3f} | {base:.2f} | {'yes' if extra < TARGET_S else 'NO'} |")
        print(f"{path.name:40} parse {extra:.3f} s over the Airflow import ({base:.2f} s)", flush=True)
    lines = [
        f"Command: `make bench BENCH=dag_parse` (median of {RUNS} fresh interpreters per file).",
        "",
        "| DAG file | parse time over `import airflow.sdk` (s) | `import airflow.sdk` (s) | < 0.5 s |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Slowest DAG file: {worst:.3f} s, {worst / TARGET_S:.2f}x of the 0.5 s target.",
    ]
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "dag_parse.md").write_text("\n".join(lines) + "\n")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
