"""Run kubetrain's benchmarks and gather their results into bench/README.md.

Each benchmark is a script in bench/ that runs in the environment it measures, prints
its ratios and writes bench/results/<name>.md. ``make bench`` runs them all;
``make bench BENCH="transfer dag_parse"`` runs some.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AIRFLOW = REPO / ".venv" / "bin" / "python"
TRAINER = REPO / "trainer" / ".venv" / "bin" / "python"

# name -> (interpreter, script, what it measures)
BENCHES = {
    "input_pipeline": (
        TRAINER,
        "bench_input_pipeline.py",
        "image input pipeline vs. the naive one (examples/s)",
    ),
    "train_step": (
        TRAINER,
        "bench_train_step.py",
        "training step time: steps per execution 1 vs 16, XLA off/on",
    ),
    "gpu_step": (
        TRAINER,
        "bench_gpu_step.py",
        "the classifier's network on a GPU: host-fed vs. compute-only step time, K 1 vs. 16, mixed precision",
    ),
    "transfer": (TRAINER, "bench_transfer.py", "S3 stage-in vs. s5cmd and awscli (wall time, client CPU/GB)"),
    "image_update": (
        AIRFLOW,
        "bench_image_update.py",
        "code-only image update: append layer vs. buildah build",
    ),
    "oci_append": (
        AIRFLOW,
        "bench_oci_append.py",
        "appending a code layer in the registry: our OCI client vs. oras-py and skopeo (bytes, wall time)",
    ),
    "images": (
        AIRFLOW,
        "bench_node_images.py",
        "the node's image cache: image sizes, cold and warm pulls, a code layer's cost to the next pod start",
    ),
    "dag_parse": (
        AIRFLOW,
        "bench_dag_parse.py",
        "DAG file parse time: (a) warm, as the DAG processor parses, (b) cold import",
    ),
    "orchestration": (AIRFLOW, "bench_orchestration.py", "orchestration overhead of the demo DAG"),
    "kill_soak": (
        AIRFLOW,
        "bench_kill_soak.py",
        "training runs killed at random points: resumed, steps lost, orphans",
    ),
    "sweep": (
        AIRFLOW,
        "bench_sweep.py",
        "16-trial random sweep without stopping, with median and with asha: compute saved, wall vs. ideal, per-trial overhead",
    ),
    "runs_page": (
        AIRFLOW,
        "bench_runs_page.py",
        "the Training page's API with 100,000 run records, key walk and run index database",
    ),
    "distributed": (
        AIRFLOW,
        "bench_distributed.py",
        "the digits training with 1 and 2 workers on the dev stack",
    ),
    "distributed_accuracy": (
        TRAINER,
        "bench_distributed_accuracy.py",
        "final accuracy with 1 and 2 workers over several seeds",
    ),
}

HEADER = """# Benchmarks

`make bench` runs every benchmark below side by side on this machine and rewrites this
file from bench/results/. Figures are ratios measured in one run; absolute numbers depend
on the machine (the reference machine: 2 cores, 24 GiB, no GPU). Run one with
`make bench BENCH=<name>`.
"""


def main() -> int:
    wanted = os.environ.get("BENCH", "").split() or list(BENCHES)
    unknown = [w for w in wanted if w not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; expected some of {sorted(BENCHES)}", file=sys.stderr)
        return 2
    failed = []
    for name in wanted:
        python, script, what = BENCHES[name]
        path = REPO / "bench" / script
        if not path.exists():
            print(f"== {name}: {script} is missing", flush=True)
            failed.append(name)
            continue
        print(f"== {name}: {what}", flush=True)
        start = time.monotonic()
        rc = subprocess.call([str(python), str(path)], cwd=REPO)
        print(f"== {name}: exit {rc} after {time.monotonic() - start:.0f} s", flush=True)
        if rc:
            failed.append(name)
    write_readme()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def write_readme() -> None:
    parts = [HEADER]
    for name, (_, script, what) in BENCHES.items():
        result = REPO / "bench" / "results" / f"{name}.md"
        parts.append(f"\n## {name}: {what}\n\nScript: `bench/{script}`.\n")
        # bench/notes/<name>.md: the hand-written reading of a bench's figures, kept across runs
        notes = REPO / "bench" / "notes" / f"{name}.md"
        if notes.exists():
            parts.append("\n" + notes.read_text().strip() + "\n")
        parts.append("\n" + result.read_text().strip() + "\n" if result.exists() else "\nNot run yet.\n")
    # measured by hand, not by a script: a fresh clone's first `make demo`, phase by phase
    first_demo = REPO / "bench" / "notes" / "first_demo.md"
    if first_demo.exists():
        parts.append("\n" + first_demo.read_text().strip() + "\n")
    (REPO / "bench" / "README.md").write_text("".join(parts))


if __name__ == "__main__":
    raise SystemExit(main())
