"""The Training page's API at 100,000 run records: today's key walk and the run index database side by side.

Seeds ``KUBETRAIN_BENCH_RECORDS`` (default 100,000) run records for 4 models, 5 DAGs, 20 dataset
versions, 2 % failed, into the dev stack's S3 server (rclone's, objects as files) in bulk:

* the key-named index as the record step writes it (the run's record, its two index copies and
  its leaderboard entry: ``record_keys``), written as files straight into the server's data
  directory, the copies hard links of the record (writing 400,000 objects through S3 took
  ~290 s per 10,000 records); the server lists and serves them as any object;
* the run index database's snapshot, built in memory from the same records
  (``RunsDb.upsert``) and put through S3, then 20 runs more written through the record step
  (``RunRepository.write``: record, copies, delta), so the database folds deltas as in use.

Then times the page's requests through kubetrain's FastAPI app (the routes the API server
mounts, JSON and HTML), median of ``RUNS`` after one warm-up, twice over the same S3: with
the app as before this database (``TrainingQueries`` without an index: the key walk, at most
5,000 keys per request, then "search on") and with the database (one ListObjectsV2 of
``index/_db/``, one local query). The cases: the first page (JSON and HTML), the next page, a
model's runs, each filter (DAG, dataset version, status), their combinations, one that matches
nothing; and, once, a model's leaderboard and a two-run comparison (not served by the database).
Also: the API server's first request (it reads the snapshot) and a request that folds 10 new
deltas. The load average is recorded before and after.

The viewer's login is a fixed user and the DAG list an in-process answer (the auth manager's
metadata-DB query is Airflow's, not measured here); S3 is reached over HTTP as in production.
"""

from __future__ import annotations

import contextlib
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
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins")]

RECORDS = int(os.environ.get("KUBETRAIN_BENCH_RECORDS", "100000"))
RUNS = 5
TARGET_MS = 300
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


def app(readable: set[str], *, with_index: bool):
    """kubetrain's FastAPI app as the API server mounts it, with a fixed viewer.

    :param with_index: ``False``: the app as before the run index database (its queries walk the keys).
    """
    import airflow.api_fastapi.app as airflow_app
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi import FastAPI

    import kubetrain.store.runs_db as runs_db

    class Viewer:
        def get_authorized_dag_ids(self, *, user, method="GET"):
            return set(readable)

    airflow_app.get_auth_manager = lambda: Viewer()
    from kubetrain.ui.app import create_router

    cached = runs_db.cached_index
    if not with_index:
        runs_db.cached_index = lambda store, endpoint="": None  # TrainingQueries(store, dags, None)
    try:
        router = create_router()
    finally:
        runs_db.cached_index = cached
    sub = FastAPI()
    sub.include_router(router)
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


def seed(data: Path, store, records: list) -> dict[str, float]:
    """Write the key-named index as files in the S3 server's bucket directory (the index copies hard
    links of the record) and build the database from the same documents; put its snapshot through S3."""
    from kubetrain.s3_layout import S3Layout
    from kubetrain.store import runs_db
    from kubetrain.store.index import index_name, record_keys

    layout = S3Layout()
    started = time.monotonic()
    objects = 0
    made: set[Path] = set()
    db = runs_db.RunsDb()
    written = runs_db.now_ms() - 2 * runs_db.GRACE_MS
    for record in records:
        body = record.to_json(indent=1) + "\n"
        keys = record_keys(layout, record)
        first = data / keys[0]
        for key in keys:
            path = data / key
            if path.parent not in made:
                path.parent.mkdir(parents=True, exist_ok=True)
                made.add(path.parent)
            if key == keys[0]:
                path.write_text(body)
            else:
                os.link(first, path)
            objects += 1
        db.upsert(index_name(record), json.loads(body), written)
    db.set_meta("deltas_through", str(written))
    snapshot = db.serialize()
    both = time.monotonic() - started
    started = time.monotonic()
    store.write(
        store.layout.training_bucket, runs_db.SNAPSHOT_KEY, snapshot, content_type="application/vnd.sqlite3"
    )
    return {
        "seconds": both,
        "objects": objects,
        "put": time.monotonic() - started,
        "snapshot_bytes": len(snapshot),
    }


def main() -> int:
    import boto3
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
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

        from kubetrain.run_store import RunStore
        from kubetrain.s3_layout import S3Layout

        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )
        store = RunStore(S3Hook(aws_conn_id="aws_default"), S3Layout())
        started = time.monotonic()
        records = make_records(RECORDS + 30)
        records, later, fold = records[:RECORDS], records[RECORDS : RECORDS + 20], records[RECORDS + 20 :]
        made_s = time.monotonic() - started
        seeding = seed(work / "s3" / "training", store, records)
        seeding["made"] = made_s
        snapshot_bytes = seeding["snapshot_bytes"]
        for record in later:  # through the record step: record, index copies, delta
            store.runs.write(record)
        print(f"seeded {len(records):,} records: {seeding}", flush=True)

        # as context managers, the clients keep one event loop and its worker threads, as the API
        # server does: each thread keeps its S3 client (else every request would create one, ~0.2 s)
        stack = contextlib.ExitStack()
        today = stack.enter_context(TestClient(app(set(DAGS), with_index=False)))
        indexed = stack.enter_context(TestClient(app(set(DAGS), with_index=True)))

        def get(http, path, **params):
            answer = http.get(f"/kubetrain/training{path}", params=params)
            assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
            return answer

        count_s3_requests()
        started = time.perf_counter()
        first = get(indexed, "/api/runs").json()  # the API server's first request: reads the snapshot
        cold_s = time.perf_counter() - started
        assert first["source"] == "db", first["source"]
        refs = [r["ref"] for r in first["runs"][:2]]
        for ref in refs:  # the compared runs' curves
            rows_csv = "epoch,step,loss,accuracy,val_loss,val_accuracy\n" + "".join(
                f"{e},{e * 100},{1 / e:.4f},{1 - 0.5 / e:.4f},{1.1 / e:.4f},{1 - 0.6 / e:.4f}\n"
                for e in range(1, 6)
            )
            client.put_object(Bucket="training", Key=f"runs/{ref}/output/history.csv", Body=rows_csv.encode())

        newest = later[-1]
        combo = {
            "model": newest.model,
            "dag_id": newest.dag_id,
            "dataset_version": newest.dataset.version,
            "status": "success",
        }
        cases = [
            ("first page, newest first (JSON)", "/api/runs", {}),
            ("first page (HTML)", "/", {}),
            ("next page (after=)", "/api/runs", {"after": first["next_after"]}),
            ("one model's runs", "/api/runs", {"model": "digits"}),
            ("one DAG", "/api/runs", {"dag_id": "train_custom_container"}),
            ("one dataset version", "/api/runs", {"dataset_version": newest.dataset.version}),
            ("status: failed", "/api/runs", {"status": "failed"}),
            (
                "DAG + status (failed runs of one DAG)",
                "/api/runs",
                {"dag_id": "retrain_nightly", "status": "failed"},
            ),
            ("model + DAG + dataset version + status", "/api/runs", combo),
            ("model + status: failed", "/api/runs", {"model": "faces", "status": "failed"}),
            ("a filter that matches nothing", "/api/runs", {"dataset_version": "0" * 16}),
        ]
        load_before = os.getloadavg()
        rows = []
        for name, path, params in cases:
            measured = []
            for http in (today, indexed):
                params_here = dict(params)
                if name.startswith("next page") and http is today:
                    params_here["after"] = get(today, "/api/runs").json()["next_after"]
                seconds, answer, requests = timed(
                    lambda http=http, p=params_here, path=path: get(http, path, **p)
                )
                measured.append((seconds, describe(answer), requests))
            rows.append((name, *measured))
            print(name, [(f"{m[0] * 1000:.0f} ms", m[1], m[2]) for m in measured], flush=True)
        once = []
        for name, path, params, check in (
            (
                "leaderboard of one model",
                "/api/models/digits/leaderboard",
                {},
                lambda a: f"{len(a.json()['entries'])} ranked",
            ),
            (
                "two runs compared (HTML, with the chart)",
                "/compare",
                {"run": refs},
                lambda a: "chart drawn" if "<svg" in a.text else "table only",
            ),
        ):
            seconds, answer, requests = timed(lambda path=path, params=params: get(indexed, path, **params))
            once.append((name, seconds, check(answer), requests))
        for record in fold:  # 10 runs recorded since the last request: the next one folds their deltas
            store.runs.write(record)
        REQUESTS.clear()
        started = time.perf_counter()
        folded = get(indexed, "/api/runs").json()
        fold_s, fold_requests = time.perf_counter() - started, dict(REQUESTS)
        assert folded["runs"][0]["run_id"] == fold[-1].run_id
        load_after = os.getloadavg()
        stack.close()
        write_result(
            rows, once, seeding, snapshot_bytes, cold_s, (fold_s, fold_requests), load_before, load_after
        )
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def describe(answer) -> str:
    if answer.headers.get("content-type", "").startswith("text/html"):
        text = answer.text
        shown = f"{text.count('<tr data-ref')} rows"
        return shown + ("; incomplete: search on" if "Searched the newest" in text else "")
    page = answer.json()
    shown = f"{len(page['runs'])} runs"
    if not page["searched_all"]:
        shown += f"; incomplete: stopped after {page['scanned']:,} keys, search on"
    return shown


def requests_text(requests: dict[str, int]) -> str:
    return f"{requests.get('ListObjectsV2', 0)} / {requests.get('GetObject', 0)}"


def verdict(seconds: float, shown: str) -> str:
    return "met" if seconds * 1000 <= TARGET_MS and "incomplete" not in shown else "not met"


def write_result(rows, once, seeding, snapshot_bytes, cold_s, fold, load_before, load_after) -> None:
    fold_s, fold_requests = fold
    lines = [
        "Command: `make bench BENCH=runs_page` (`.venv/bin/python bench/bench_runs_page.py`)",
        "",
        f"{RECORDS:,} run records of {len(MODELS)} models and {len(DAGS)} DAGs (20 dataset versions, 2 % failed) in "
        f"the embedded S3 (rclone's S3 server, objects as files, over HTTP with SigV4): {seeding['objects']:,} objects "
        f"of the key-named index written as files and the database built from the same documents in "
        f"{seeding['seconds']:.0f} s (the records made in {seeding['made']:.0f} s), its snapshot "
        f"({snapshot_bytes / 1e6:.1f} MB) put in {seeding['put']:.1f} s, then 20 records through the record step. Times are of kubetrain's FastAPI app as the API server mounts it (the viewer fixed: the auth "
        f"manager's DAG query is not included), median of {RUNS} after a warm-up; both designs on the same S3 in "
        f"one run. Machine: {os.cpu_count()} cores, Python {platform.python_version()}, load average (1, 5, 15 min) "
        f"{', '.join(f'{v:.1f}' for v in load_before)} before, {', '.join(f'{v:.1f}' for v in load_after)} after.",
        "",
        f"| request | today: key walk | answer | LIST / GET | run index database | answer | LIST / GET | "
        f"{TARGET_MS} ms, complete |",
        "|---|---:|---|---:|---:|---|---:|---|",
    ]
    for name, (t_s, t_shown, t_req), (d_s, d_shown, d_req) in rows:
        lines.append(
            f"| {name} | {t_s * 1000:,.0f} ms | {t_shown} | {requests_text(t_req)} | {d_s * 1000:,.0f} ms | "
            f"{d_shown} | {requests_text(d_req)} | today {verdict(t_s, t_shown)}, database {verdict(d_s, d_shown)} |"
        )
    for name, seconds, shown, requests in once:
        lines.append(
            f"| {name} (the same code in both) | - | - | - | {seconds * 1000:,.0f} ms | {shown} | "
            f"{requests_text(requests)} | - |"
        )
    lines += [
        "",
        f"The API server's first request reads the snapshot: {cold_s:,.2f} s for {snapshot_bytes / 1e6:.1f} MB. "
        f"A request after 10 runs were recorded folds their deltas: {fold_s * 1000:,.0f} ms "
        f"({requests_text(fold_requests)} LIST / GET).",
    ]
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text("\n".join(lines) + "\n")
    print(RESULT.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
