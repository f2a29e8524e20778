"""The Training page's API with 10,000 run records in the dev stack's S3 (rclone's S3 server).

Seeds 10,000 run records as the record step writes them (the run's record, its two index
copies and its leaderboard entry: the run store's ``record_keys``) for 4 models, 5 DAGs, 20
dataset versions, 2 % failed, then times the page's requests through kubetrain's FastAPI app
(the routes the API server mounts, JSON and HTML), median of 7 after one warm-up:

* the runs page, newest first, no filter (one ListObjectsV2 of 51 keys, 50 parallel GETs);
* one model's runs (the model's own index);
* a filter that the index's key names answer (DAG + status) and one that matches nothing
  (the worst case: ListObjectsV2 requests of 1,000 keys, no GET, until the 5,000-key bound);
* the next page (``after``), one model's leaderboard, a two-run comparison;
* for scale, what the page would cost without the index: reading every run's record.

The viewer's login is a fixed user and the DAG list an in-process answer (the auth manager's
metadata-DB query is Airflow's, not measured here); S3 is reached over HTTP as in production.
"""

from __future__ import annotations

import json
import os
import platform
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins")]

RECORDS = int(os.environ.get("KUBETRAIN_BENCH_RECORDS", "10000"))
RUNS = 7
MODELS = ("digits", "dialogue", "faces", "churn")
DAGS = (
    "train_image_classifier",
    "train_dialogue_transformer",
    "train_custom_container",
    "retrain_nightly",
    "sweep_image_classifier",
)
T0 = datetime(2026, 1, 1, tzinfo=UTC)
RESULT = REPO / "bench" / "results" / "runs_page.md"


def start_s3() -> tuple[subprocess.Popen, str, str, str, Path]:
    from include.devstack.stack import free_port, wait_http

    port = free_port()
    key, secret = "kt" + secrets.token_hex(8), secrets.token_urlsafe(30)
    work = Path(tempfile.mkdtemp())
    log = open(work / "s3.log", "wb")  # noqa: SIM115 - kept open for the server's life
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "include.devstack.s3",
            "--port",
            str(port),
            "--data-dir",
            str(work / "s3"),
            "--buckets",
            "training",
        ],
        cwd=REPO,
        env={**os.environ, "KUBETRAIN_S3_ACCESS_KEY_ID": key, "KUBETRAIN_S3_SECRET_ACCESS_KEY": secret},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    endpoint = f"http://127.0.0.1:{port}"
    wait_http(f"{endpoint}/", 60, proc, Path(log.name))  # the bucket exists before it answers
    return proc, endpoint, key, secret, work


def make_records(count: int) -> list[dict]:
    from kubetrain.run_record import RunFacts, build_record
    from kubetrain.s3_layout import S3Layout

    rng = random.Random(17)
    layout = S3Layout()
    versions = [f"{rng.getrandbits(64):016x}" for _ in range(20)]
    records = []
    for i in range(count):
        dag, model = DAGS[i % len(DAGS)], MODELS[(i // 3) % len(MODELS)]
        run_id = f"scheduled__{(T0 + timedelta(minutes=7 * i)).isoformat()}"
        failed = rng.random() < 0.02
        value = round(rng.uniform(0.6, 0.99), 5)
        metrics = {
            "trainer": "image_classifier",
            "monitor": "val_accuracy",
            "monitor_mode": "max",
            "final": {"loss": 0.3, "accuracy": value, "val_loss": 0.4, "val_accuracy": value},
            "best": {"val_accuracy": value, "epoch": 5},
            "epochs": 5,
            "steps": 500,
            "resumed_from_step": 0,
            "wall_time_s": rng.uniform(30, 3000),
            "examples_per_s": 900.0,
        }
        records.append(
            build_record(
                RunFacts(
                    dag_id=dag,
                    run_id=run_id,
                    run=layout.run(dag, run_id),
                    run_time=T0 + timedelta(minutes=7 * i),
                    model=model,
                    status="failed" if failed else "success",
                    params={"epochs": 5, "batch_size": rng.choice([32, 64, 128])},
                    metrics=None if failed else metrics,
                    run_params={
                        "hyperparameters": {"epochs": 5, "learning_rate": rng.choice([1e-3, 3e-4])},
                        "code_version": "v1",
                    },
                    dataset_uri=f"s3://datasets/{model}/",
                    dataset_version=rng.choice(versions),
                    image="registry.example/kubetrain/trainer@sha256:" + "a" * 64,
                    promote_rule="if_better",
                    promotion={"promoted": False},
                    report={"report_uri": f"s3://training/runs/{dag}/x/report/report.html"},
                    failure={"task": "train", "error": "OOMKilled"} if failed else None,
                )
            )
        )
    return records


def seed(client, records: list[dict]) -> float:
    from kubetrain.s3_layout import S3Layout
    from kubetrain.store.index import record_keys

    layout = S3Layout()
    jobs = []
    for record in records:
        body = (record.to_json(indent=1) + "\n").encode()
        jobs += [(key, body) for key in record_keys(layout, record)]
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda job: client.put_object(Bucket="training", Key=job[0], Body=job[1]), jobs))
    return time.monotonic() - started, len(jobs)


def app(readable: set[str]):
    """kubetrain's FastAPI app as the API server mounts it, with a fixed viewer."""
    import airflow.api_fastapi.app as airflow_app
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi import FastAPI

    class Viewer:
        def get_authorized_dag_ids(self, *, user, method="GET"):
            return set(readable)

    airflow_app.get_auth_manager = lambda: Viewer()
    from kubetrain.ui.app import create_router

    sub = FastAPI()
    sub.include_router(create_router())
    sub.dependency_overrides[get_user] = lambda: object()
    root = FastAPI()
    root.mount("/kubetrain", sub)
    return root


REQUESTS: dict[str, int] = {}


def count_s3_requests() -> None:
    """Count the S3 operations every botocore client sends (ListObjectsV2, GetObject, ...)."""
    import botocore.endpoint

    original = botocore.endpoint.Endpoint.make_request

    def counting(self, operation_model, request_dict):
        REQUESTS[operation_model.name] = REQUESTS.get(operation_model.name, 0) + 1
        return original(self, operation_model, request_dict)

    botocore.endpoint.Endpoint.make_request = counting


def timed(fn) -> tuple[float, object, dict[str, int]]:
    fn()  # warm-up
    REQUESTS.clear()
    fn()
    requests = dict(REQUESTS)
    times, answer = [], None
    for _ in range(RUNS):
        started = time.perf_counter()
        answer = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), answer, requests


def main() -> int:
    import boto3
    from fastapi.testclient import TestClient

    proc, endpoint, key, secret, work = start_s3()
    try:
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps(
            {
                "conn_type": "aws",
                "login": key,
                "password": secret,
                "extra": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            }
        )
        os.environ.pop("KUBETRAIN_TRAINING_BUCKET", None)
        import airflow  # noqa: F401

        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )
        records = make_records(RECORDS)
        seed_s, objects = seed(client, records)
        print(f"seeded {len(records)} run records ({objects} objects) in {seed_s:.0f} s", flush=True)
        http = TestClient(app(set(DAGS)))

        def get(path, **params):
            answer = http.get(f"/kubetrain/training{path}", params=params)
            assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
            return answer

        first = get("/api/runs").json()
        refs = [r["ref"] for r in first["runs"][:2]]
        for ref in refs:  # the compared runs' curves
            rows_csv = "epoch,step,loss,accuracy,val_loss,val_accuracy\n" + "".join(
                f"{e},{e * 100},{1 / e:.4f},{1 - 0.5 / e:.4f},{1.1 / e:.4f},{1 - 0.6 / e:.4f}\n"
                for e in range(1, 6)
            )
            client.put_object(Bucket="training", Key=f"runs/{ref}/output/history.csv", Body=rows_csv.encode())
        rows = []

        count_s3_requests()

        def case(name, fn, check):
            seconds, answer, requests = timed(fn)
            shown = check(answer)
            lists, gets = requests.get("ListObjectsV2", 0), requests.get("GetObject", 0)
            rows.append((name, seconds, shown, lists, gets))
            print(f"{name}: {seconds * 1000:.0f} ms ({shown})", flush=True)

        def count(answer):
            return f"{len(answer.json()['runs'])} runs"

        case("runs, newest first (JSON)", lambda: get("/api/runs"), count)
        case(
            "runs, newest first (HTML page)",
            lambda: get("/"),
            lambda a: f"{a.text.count('<tr data-ref')} rows",
        )
        case("one model's runs", lambda: get("/api/runs", model="digits"), count)
        case("next page (after=)", lambda: get("/api/runs", after=first["next_after"]), count)
        case(
            "DAG + status filter (failed runs of one DAG)",
            lambda: get("/api/runs", dag_id="train_custom_container", status="failed"),
            count,
        )
        case(
            "a filter that matches nothing (stops after 5,000 keys)",
            lambda: get("/api/runs", dataset_version="0" * 16),
            count,
        )
        case(
            "leaderboard of one model",
            lambda: get("/api/models/digits/leaderboard"),
            lambda a: f"{len(a.json()['entries'])} ranked",
        )
        case(
            "two runs compared (HTML, with the chart)",
            lambda: get("/compare", run=refs),
            lambda a: "chart drawn" if "<svg" in a.text else "no history: table only",
        )

        from kubetrain.s3_layout import S3Layout
        from kubetrain.store.index import record_keys

        every = [record_keys(S3Layout(), r)[0] for r in records]

        def read_all():
            with ThreadPoolExecutor(10) as pool:
                return list(
                    pool.map(lambda k: client.get_object(Bucket="training", Key=k)["Body"].read(), every)
                )

        started = time.perf_counter()
        read_all()
        naive = time.perf_counter() - started
        print(f"reading every run's record: {naive:.1f} s", flush=True)
        write_result(rows, naive, seed_s, objects)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def write_result(rows, naive: float, seed_s: float, objects: int) -> None:
    from kubetrain.ui.queries import MAX_SCAN

    first_page = rows[0][1]
    lines = [
        "Command: `make bench BENCH=runs_page` (`.venv/bin/python bench/bench_runs_page.py`)",
        "",
        f"{RECORDS:,} run records ({objects:,} objects: each record, its two index copies and, when it succeeded, its "
        f"leaderboard entry; seeded in {seed_s:.0f} s) of {len(MODELS)} models and {len(DAGS)} DAGs in the embedded S3 "
        "(rclone's S3 server, objects as files, over HTTP with SigV4). Times are of kubetrain's FastAPI app as the API server mounts it (the viewer fixed: "
        f"the auth manager's DAG query is not included), median of {RUNS} after a warm-up. "
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}.",
        "",
        "| request | time | answer | ListObjectsV2 | GetObject |",
        "|---|---:|---|---:|---:|",
    ]
    for name, seconds, shown, lists, gets in rows:
        lines.append(f"| {name} | {seconds * 1000:,.0f} ms | {shown} | {lists} | {gets} |")
    lines += [
        f"| for scale: reading every run's record (10 threads), what a page without the index would need | "
        f"{naive:,.1f} s | {RECORDS:,} records | - | {RECORDS:,} |",
        "",
        f"The first page costs **{first_page * 1000:,.0f} ms** with {RECORDS:,} records, "
        f"{naive / first_page:,.0f}x less than reading every record. The requests it makes do not grow with the number "
        "of runs (one list of 51 keys, then the 50 records it shows), and neither do a model's leaderboard's (its keys "
        "sort best first). A filter that matches few runs lists the index's keys (1,000 per request, no GET) until the "
        f"page is full or {MAX_SCAN:,} keys were read; then the page says so and offers to search on from there.",
    ]
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text("\n".join(lines) + "\n")
    print(RESULT.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
