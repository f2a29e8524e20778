"""Orchestration overhead of the demo DAG: run wall time minus the trainer's own wall time.

Starts a private dev stack, pushes the CPU trainer and sync images (built from their
Dockerfiles) to its registry, uploads the digits demo dataset and runs
train_image_classifier once through `airflow dags test` (a private Airflow home), then
compares the whole run's wall time with the `wall_time_s` the trainer wrote into
metrics.json. The difference is what kubetrain adds: staging, the pod's start, stage-in,
the checkpoint sidecar's final pass, the report and the promotion.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from include.demo import AIRFLOW, DEMOS, upload_dataset  # noqa: E402
from include.devstack.stack import Stack, s3_client  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_sweep import publish_images  # noqa: E402


def main() -> int:

    demo = DEMOS["image_classifier"]
    conf = {**demo.conf, "epochs": 3, "force": True}
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-") as tmp:
        stack = Stack(Path(tmp) / "stack")
        stack.up()
        try:
            env_vars = stack.env()
            publish_images(stack)
            upload_dataset(demo, env_vars)
            home = Path(tmp) / "airflow"
            home.mkdir()
            shutil.copy(REPO / ".airflow" / "airflow.db", home / "airflow.db")
            env = {
                **os.environ,
                **env_vars,
                "AIRFLOW_HOME": str(home),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
                "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
                "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            }
            start = time.monotonic()
            out = subprocess.run(
                [str(AIRFLOW), "dags", "test", demo.dag_id, "-c", json.dumps(conf)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
            )
            wall = time.monotonic() - start
            with sqlite3.connect(home / "airflow.db") as db:
                row = db.execute(
                    "SELECT run_id, state FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1",
                    (demo.dag_id,),
                ).fetchone()
                run_id, state = row or (None, None)
                if out.returncode or state != "success":
                    print(out.stdout[-3000:], out.stderr[-3000:])
                    print(f"the demo run failed ({state}, exit {out.returncode})", file=sys.stderr)
                    return 1
                run_uri = json.loads(
                    db.execute(
                        "SELECT value FROM xcom WHERE dag_id = ? AND run_id = ? AND task_id = 'train' AND key = 'run_uri'",
                        (demo.dag_id, run_id),
                    ).fetchone()[0]
                )
            s3 = s3_client(env_vars)
            bucket, _, prefix = run_uri[len("s3://") :].partition("/")
            metrics = json.loads(
                s3.get_object(Bucket=bucket, Key=f"{prefix}/output/metrics.json")["Body"].read()
            )
        finally:
            stack.down()
    trainer = float(metrics["wall_time_s"])
    overhead = wall - trainer
    lines = [
        "Command: `make bench BENCH=orchestration` (train_image_classifier on the digits demo data, "
        f"{conf['epochs']} epochs, through `airflow dags test` against the dev stack).",
        "",
        "| DAG run wall time (s) | trainer wall time (s) | overhead (s) | overhead / run |",
        "|---|---|---|---|",
        f"| {wall:.1f} | {trainer:.1f} | {overhead:.1f} | {overhead / wall:.2f} |",
        "",
        "The overhead covers Airflow's task start-up for six tasks, staging, the pod's init "
        "container (stage-in), the checkpoint sidecar's final pass, the report and promotion.",
    ]
    print("\n".join(lines))
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "orchestration.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
