"""Parse time of each DAG file over the bare Airflow import (target: < 0.5 s each).

Each measurement is a fresh interpreter that first imports ``airflow.sdk`` (the bare cost
every DAG file pays) and then executes one DAG file. Two figures per file, medians of 5:

* cold: the DAG file with everything it imports (what a first parse pays);
* warm: the DAG file once the modules it imports are loaded, which is how Airflow's DAG
  processor parses it again and again (``[dag_processor] parsing_pre_import_modules``,
  on by default, imports a file's modules before each parse).

For scale, the same is measured for a reference DAG holding one plain
KubernetesPodOperator: the cold figure of any DAG file that imports that operator, since the
cncf-kubernetes provider loads the ``kubernetes`` and ``kubernetes_asyncio`` clients. Our
TrainingPodOperator builds its KubernetesPodOperator only when the task runs, so the training
DAG files stay off that floor.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = 5
TARGET_S = 0.5

PROBE = r"""
import ast, importlib, importlib.util, json, sys, time
path = sys.argv[1]
t0 = time.perf_counter()
import airflow.sdk  # noqa: F401
t1 = time.perf_counter()
if sys.argv[2] == "warm":
    # what parsing_pre_import_modules does: import the file's top-level modules first
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            importlib.import_module(node.module)
t2 = time.perf_counter()
spec = importlib.util.spec_from_file_location("dagfile", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
t3 = time.perf_counter()
print(json.dumps({"airflow": t1 - t0, "dag": t3 - t2}))
"""

REFERENCE = '''
from __future__ import annotations
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import DAG
with DAG(dag_id="reference_pod", schedule=None, catchup=False, tags=["reference"]):
    KubernetesPodOperator(task_id="pod", image="busybox", cmds=["true"])
'''


def measure(path: Path, mode: str) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins")}
    base, extra = [], []
    for _ in range(RUNS):
        out = subprocess.run([sys.executable, "-c", PROBE, str(path), mode], capture_output=True, text=True, env=env, cwd=REPO)
        if out.returncode:
            raise SystemExit(f"{path.name} failed to parse:\n{out.stderr[-2000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        base.append(result["airflow"])
        extra.append(result["dag"])
    return statistics.median(base), statistics.median(extra)


def main() -> int:
    files = sorted(p for p in (REPO / "dags").glob("*.py") if not p.name.startswith("_"))
    rows, worst_warm, worst_cold = [], 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "reference_pod.py"
        reference.write_text(REFERENCE)
        for path in [*files, reference]:
            base, cold = measure(path, "cold")
            _, warm = measure(path, "warm")
            name = path.name if path != reference else "(reference: one plain KubernetesPodOperator)"
            if path != reference:
                worst_warm, worst_cold = max(worst_warm, warm), max(worst_cold, cold)
            met = "yes" if max(cold, warm) < TARGET_S else "NO"
            rows.append(f"| {name} | {cold:.3f} | {warm:.3f} | {base:.2f} | {met} |")
            print(f"{name:45} cold {cold:.3f} s, warm {warm:.3f} s over the Airflow import ({base:.2f} s)", flush=True)
    lines = [
        f"Command: `make bench BENCH=dag_parse` (median of {RUNS} fresh interpreters per file and mode).",
        "",
        "| DAG file | cold parse over `import airflow.sdk` (s) | warm parse, modules pre-imported (s) | `import airflow.sdk` (s) | both < 0.5 s |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Slowest warm parse (how the DAG processor re-parses): {worst_warm:.3f} s, "
        f"{worst_warm / TARGET_S:.2f}x of the 0.5 s target.",
        f"Slowest cold parse (a DAG processor's first parse): {worst_cold:.3f} s, "
        f"{worst_cold / TARGET_S:.2f}x of the target: {'met' if worst_cold < TARGET_S else 'NOT met'}.",
        "",
        "No DAG file imports the KubernetesPodOperator: TrainingPodOperator and the image build "
        "operators create it when the task runs (plugins/kubetrain/operators/_training_pod.py), so a "
        "DAG file does not load the `kubernetes` and `kubernetes_asyncio` clients that the reference "
        "row pays.",
    ]
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "dag_parse.md").write_text("\n".join(lines) + "\n")
    return 0 if max(worst_warm, worst_cold) < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
