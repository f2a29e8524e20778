"""
### Watch datasets for new versions

Every few minutes, stages each watched dataset: when its objects changed (keys, sizes or
ETags), a new snapshot manifest is written and the dataset's Asset gets an event carrying
the new version, which triggers the training DAGs scheduled on it. An unchanged dataset
writes nothing and emits nothing (its task is skipped), so the same data uploaded again
triggers no retraining.

Watched datasets: `KUBETRAIN_WATCHED_DATASETS` (comma-separated S3 URIs; default the two
demo datasets). Schedule: `KUBETRAIN_WATCH_CRON` (default every 10 minutes).
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG

from kubetrain import DEFAULT_ARGS, StageDatasetOperator, dataset_asset, dataset_name_from_uri, environ

WATCHED = [
    u.strip()
    for u in (
        environ("KUBETRAIN_WATCHED_DATASETS", "s3://datasets/digits/,s3://datasets/dialogue/") or ""
    ).split(",")
    if u.strip()
]

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=environ("KUBETRAIN_WATCH_CRON", "*/10 * * * *"),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "datasets"],
) as dag:
    for uri in WATCHED:
        StageDatasetOperator(
            task_id=f"stage_{dataset_name_from_uri(uri).replace('.', '_').replace('-', '_')}",
            source_uri=uri,
            outlets=[dataset_asset(uri)],
            skip_if_unchanged=True,
        )
