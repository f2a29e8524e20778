"""`make demo-sweep`: a small hyperparameter sweep of the digits classifier on the dev stack.

    python -m include.demo_sweep

Runs sweep_image_classifier through `airflow dags test` (random search, 6 trials, 2 at a time,
asha early stopping), then prints the leaderboard's S3 location with the compute the stopping
saved, and copies the leaderboard into .demo/.
Runs in the Airflow environment (.venv) against a running dev stack with kubetrain's images
(`make stack-images`; `make demo-sweep` does both).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from include.demo import (  # noqa: E402
    AIRFLOW,
    DEMO_DIR,
    DEMOS,
    _short,
    _worth_showing,
    airflow_env,
    dag_runs,
    require_images,
    stack_env,
    upload_dataset,
)
from include.devstack.stack import s3_client  # noqa: E402

DAG_ID = "sweep_image_classifier"
CONF = {
    "dataset_uri": "s3://datasets/digits/",
    "model_name": "image-classifier-sweep",
    # 9 epochs of a few seconds each' training: asha's rungs at 1 and 3 epochs (reduction factor 3)
    # stop most of the trials there; the wide learning-rate range has points that stay bad.
    "epochs": 9,
    "image_size": 16,
    "cpu": "1",
    "memory": "2Gi",
    "space": {"learning_rate": {"low": 0.00001, "high": 1.0, "log": True}, "batch_size": [32]},
    "algorithm": "random",
    "max_trials": 6,
    "parallel_trials": 2,
    "seed": 7,
    "early_stopping": {"rule": "asha", "min_resource": 1, "reduction_factor": 3, "max_resource": 9},
}


def _sweep_line(line: str) -> bool:
    return _worth_showing(line) or any(k in line for k in ("Leaderboard of", "early stop", "reused"))


def main() -> int:
    stack = stack_env()
    env = airflow_env(stack)
    require_images(stack)
    upload_dataset(DEMOS["image_classifier"], stack)
    DEMO_DIR.mkdir(exist_ok=True)
    log = DEMO_DIR / f"{DAG_ID}.log"
    print(f"running {DAG_ID} with `airflow dags test` (log: {log.relative_to(REPO)}) ...", flush=True)
    print("  conf: " + json.dumps(CONF), flush=True)
    before = {r["run_id"] for r in dag_runs(DAG_ID, env)}
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(AIRFLOW), "dags", "test", DAG_ID, "-c", json.dumps(CONF)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in proc.stdout:
            out.write(line)
            if _sweep_line(line):
                print("  " + _short(line), flush=True)
        rc = proc.wait()
    runs = [r for r in dag_runs(DAG_ID, env) if r["run_id"] not in before]
    if not runs:
        print(f"error: `airflow dags test` recorded no run of {DAG_ID}; see {log}", file=sys.stderr)
        return 1
    run_id, state = runs[-1]["run_id"], runs[-1]["state"]
    print(f"{DAG_ID} run {run_id}: {state} in {time.monotonic() - start:.0f} s", flush=True)
    if rc or state != "success":
        print(f"error: the sweep did not succeed; see {log}", file=sys.stderr)
        return 1

    sys.path.insert(0, str(REPO / "plugins"))
    from kubetrain.s3_layout import S3Layout

    s3 = s3_client(stack)
    sweep = S3Layout(training_bucket=stack.get("KUBETRAIN_TRAINING_BUCKET") or "training").run(DAG_ID, run_id)
    record = json.loads(
        s3.get_object(Bucket=sweep.bucket, Key=f"{sweep.prefix}/sweep/sweep.json")["Body"].read()
    )
    local = DEMO_DIR / "sweep-leaderboard"
    local.mkdir(exist_ok=True)
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=sweep.bucket, Prefix=f"{sweep.prefix}/report/"
    )
    for key in (o["Key"] for page in pages for o in page.get("Contents", [])):
        s3.download_file(sweep.bucket, key, str(local / key.rsplit("/", 1)[1]))

    print("\ntrials (best first):")
    objective = record.get("objective") or {}
    ranked = sorted(
        (t for t in record["trials"] if (t.get("objective") or {}).get("value") is not None),
        key=lambda t: t["objective"]["value"],
        reverse=objective.get("mode", "max") == "max",
    )
    for trial in ranked:
        flag = "  stopped early" if trial.get("stopped_early") else ""
        print(
            f"  trial {trial['number']}: {json.dumps(trial['params'])}  "
            f"{trial['objective'].get('name', '')} {trial['objective']['value']:.4f}{flag}"
        )
    print(f"\nbest:        trial {record['best']['best_trial']} ({record['best']['best_run_uri']})")
    print(f"promotion:   {json.dumps(record.get('promotion'), default=str)}")
    print(f"leaderboard: {record['report_uri']}")
    print(f"compute:     {(record.get('compute') or {}).get('line') or 'not recorded'}")
    print(f"             copied to {local / 'report.html'} (open it in a browser: the plots are inlined)")
    print(f"sweep record: s3://{sweep.bucket}/{sweep.prefix}/sweep/sweep.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
