"""Parse time of each DAG file: (a) the warm parse as the DAG processor does it, (b) the one-time cold import.

(a) Warm, target < 0.5 s per file. Airflow's DAG processor imports the ``airflow.*`` modules a
    DAG file imports, in its long-lived manager process (``[dag_processor]
    parsing_pre_import_modules``, on by default; ``airflow.utils.file.iter_airflow_imports``
    finds them), and then parses the file in a forked child. The bench does the same: one
    process imports the DAG processor and pre-imports the file's ``airflow.*`` modules with
    Airflow's own function, then forks a child per parse and times executing the file there.
    What the file imports beyond those (kubetrain's modules) is paid on every parse.
(b) Cold: a fresh interpreter that has imported ``airflow.sdk`` executes the file with
    everything it imports: what the first parse of a new processor, or a task's start, pays
    once. Reported, no target.

Medians of 5. A reference DAG holding one plain KubernetesPodOperator shows the floor that
importing the cncf-kubernetes provider (the ``kubernetes`` and ``kubernetes_asyncio``
clients) puts under a cold import.
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

# (a): the DAG processor's procedure, with Airflow's own functions.
WARM = r"""
import importlib, importlib.util, json, os, sys, time
import airflow.sdk  # noqa: F401
import airflow.dag_processing.processor  # the DAG processor manager has this loaded
from airflow.utils.file import iter_airflow_imports
path, runs = sys.argv[1], int(sys.argv[2])
for module in iter_airflow_imports(path):
    importlib.import_module(module)
times = []
for i in range(runs):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        t0 = time.perf_counter()
        spec = importlib.util.spec_from_file_location(f"dagfile_{i}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        os.write(write, repr(time.perf_counter() - t0).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        value = fh.read()
    _, status = os.waitpid(pid, 0)
    if status or not value:
        raise SystemExit(f"parsing {path} failed in the child (status {status})")
    times.append(float(value))
print(json.dumps({"times": times}))
"""

# (b): a fresh interpreter per run.
COLD = r"""
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

REFERENCE = """
from __future__ import annotations
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import DAG
with DAG(dag_id="reference_pod", schedule=None, catchup=False, tags=["reference"]):
    KubernetesPodOperator(task_id="pod", image="busybox", cmds=["true"])
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "plugins")}


def _last_json(out: subprocess.CompletedProcess, path: Path) -> dict:
    if out.returncode:
        raise SystemExit(f"{path.name} failed to parse:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(path: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", WARM, str(path), str(RUNS)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
    )
    return statistics.median(_last_json(out, path)["times"])


def cold(path: Path) -> tuple[float, float]:
    base, dag = [], []
    for _ in range(RUNS):
        out = subprocess.run(
            [sys.executable, "-c", COLD, str(path)], capture_output=True, text=True, env=_env(), cwd=REPO
        )
        result = _last_json(out, path)
        base.append(result["airflow"])
        dag.append(result["dag"])
    return statistics.median(base), statistics.median(dag)


def main() -> int:
    files = sorted(p for p in (REPO / "dags").glob("*.py") if not p.name.startswith("_"))
    rows, worst_warm, worst_cold = [], 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "reference_pod.py"
        reference.write_text(REFERENCE)
        for path in [*files, reference]:
            warm_s = warm(path)
            base, cold_s = cold(path)
            name = path.name if path != reference else "(reference: one plain KubernetesPodOperator)"
            if path != reference:
                worst_warm, worst_cold = max(worst_warm, warm_s), max(worst_cold, cold_s)
            met = "yes" if warm_s < TARGET_S else "NO"
            rows.append(f"| {name} | {warm_s:.3f} | {met} | {cold_s:.3f} | {base:.2f} |")
            print(
                f"{name:45} warm {warm_s:.3f} s, cold {cold_s:.3f} s over the Airflow import ({base:.2f} s)",
                flush=True,
            )
    lines = [
        f"Command: `make bench BENCH=dag_parse` (median of {RUNS} per file; warm: forked parses after the DAG "
        "processor's pre-import, cold: fresh interpreters).",
        "",
        "| DAG file | (a) warm parse, as the DAG processor parses (s) | (a) < 0.5 s | (b) cold import, once (s) | `import airflow.sdk` (s) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Slowest warm parse: {worst_warm:.3f} s, {worst_warm / TARGET_S:.2f}x of the 0.5 s target: "
        f"{'met' if worst_warm < TARGET_S else 'NOT met'}.",
        f"Slowest cold import: {worst_cold:.3f} s (paid once per DAG processor, and when a task starts).",
        "",
        "The training DAG files import TrainingPodOperator, a KubernetesPodOperator subclass, so their cold "
        "import loads the cncf-kubernetes provider and the Kubernetes clients, as the reference row does. They "
        "also import the provider's pod operator module by its `airflow.` name, so the DAG processor pre-imports "
        "it once and every later parse reuses it.",
    ]
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "dag_parse.md").write_text("\n".join(lines) + "\n")
    return 0 if worst_warm < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
