"""`make demo-sweep`: a small hyperparameter sweep of the digits classifier on the dev stack.

    python -m include.demo_sweep

Runs sweep_image_classifier through `airflow dags test` (random search, 6 trials, 2 at a time,
asha early stopping), then prints the leaderboard's S3 location with the compute the stopping
saved, and copies the leaderboard, with the trials' reports it links, into .demo/sweep-leaderboard/.
Runs in the Airflow environment (.venv) against a running dev stack with kubetrain's images
(`make stack-images`; `make demo-sweep` does both).
"""

from __future__ import annotations

import json
import sys
import time
from html import escape
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from include.demo import (  # noqa: E402
    DEMO_DIR,
    DEMOS,
    DemoOutput,
    _worth_showing,
    airflow_env,
    dags_test,
    print_still_running,
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


def promotion_sentence(record: dict) -> str:
    """The sweep record's promotion in a sentence: which trial's model was promoted as what, or why none was,
    with the comparison's figures."""
    promotion = record.get("promotion") or {}
    best = (record.get("best") or {}).get("best_trial")
    reason = (record.get("comparison") or {}).get("reason")
    whose = f"trial {best}'s model" if best is not None else "no model"
    if promotion.get("promoted"):
        version = f" (version {promotion['model_version']})" if promotion.get("model_version") else ""
        return f"promoted {whose} as {promotion.get('model_uri')}{version}" + (
            f": {reason}" if reason else ""
        )
    why = promotion.get("reason") or reason or "the sweep record gives no reason"
    return f"{whose} not promoted: {why}" if best is not None else f"nothing promoted: {why}"


def copy_leaderboard(s3, record: dict, bucket: str, prefix: str, local: Path) -> list[str]:
    """Copy the leaderboard (``<prefix>/report/``) to ``local``, and each trial's report to
    ``local/trials/<n>/``, its link in the leaderboard rewritten to that copy: the leaderboard links a
    trial's report through the Airflow API server, a page that a file opened in a browser cannot reach.

    Returns the trials whose reports were copied.
    """
    local.mkdir(parents=True, exist_ok=True)
    _download_prefix(s3, bucket, f"{prefix}/report/", local)
    page = local / "report.html"
    html = page.read_text()
    copied = []
    for trial in record.get("trials") or []:
        uri, url = trial.get("report_uri"), trial.get("report_url")
        if not uri or not url:
            continue
        trial_bucket, _, key = uri[len("s3://") :].partition("/")
        folder = local / "trials" / str(trial.get("number"))
        _download_prefix(s3, trial_bucket, key.rsplit("/", 1)[0] + "/", folder)
        relative = f"trials/{trial.get('number')}/{key.rsplit('/', 1)[1]}"
        for form in {url, escape(url)}:  # as written in an attribute
            html = html.replace(f'href="{form}"', f'href="{relative}"')
        copied.append(str(trial.get("number")))
    page.write_text(html)
    return copied


def _download_prefix(s3, bucket: str, prefix: str, folder: Path) -> None:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for key in (o["Key"] for page in pages for o in page.get("Contents", [])):
        path = folder / key[len(prefix) :]
        path.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, key, str(path))


def main() -> int:
    stack = stack_env()
    env = airflow_env(stack)
    require_images(stack)
    upload_dataset(DEMOS["image_classifier"], stack)
    DEMO_DIR.mkdir(exist_ok=True)
    log = DEMO_DIR / f"{DAG_ID}.log"
    print("  conf: " + json.dumps(CONF), flush=True)
    start = time.monotonic()
    rc, run_id, state = dags_test(DAG_ID, CONF, env, log, DemoOutput(sweep=True, show=_sweep_line))
    if run_id is None:
        print(f"error: `airflow dags test` recorded no run of {DAG_ID}; see {log}", file=sys.stderr)
        return 1
    print(f"{DAG_ID} run {run_id}: {state} in {time.monotonic() - start:.0f} s", flush=True)
    if rc or state != "success":
        print(f"error: the sweep did not succeed; see {log}", file=sys.stderr)
        print_still_running(stack)
        return 1

    sys.path.insert(0, str(REPO / "plugins"))
    from kubetrain.s3_layout import S3Layout

    s3 = s3_client(stack)
    sweep = S3Layout(training_bucket=stack.get("KUBETRAIN_TRAINING_BUCKET") or "training").run(DAG_ID, run_id)
    record = json.loads(
        s3.get_object(Bucket=sweep.bucket, Key=f"{sweep.prefix}/sweep/sweep.json")["Body"].read()
    )
    local = DEMO_DIR / "sweep-leaderboard"
    copied = copy_leaderboard(s3, record, sweep.bucket, sweep.prefix, local)

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
    print(f"\nbest:         trial {record['best']['best_trial']} ({record['best']['best_run_uri']})")
    print(f"promotion:    {promotion_sentence(record)}")
    print(f"leaderboard:  {record['report_uri']}")
    print(f"compute:      {(record.get('compute') or {}).get('line') or 'not recorded'}")
    print(f"              copied to {local / 'report.html'} (open it in a browser: the plots are inlined)")
    if copied:
        print(
            f"              with the reports of trials {', '.join(copied)} in {local / 'trials'}, linked from it"
        )
    print(f"sweep record: s3://{sweep.bucket}/{sweep.prefix}/sweep/sweep.json")
    print(f"run:          {DAG_ID} run {run_id} in `make airflow` (its tasks and their logs)")
    print_still_running(stack)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
