"""
### The Training page's run index: kept compact, rebuilt when it disagrees

The Training page answers its runs list and every filter from the run index database
(`index/_db/` in the training bucket): a snapshot plus one small delta per record written.
Once a day this DAG folds the deltas into the snapshot and deletes the folded ones, so an API
server that starts reads one object and a few deltas. It then compares the database with the
key-named index (`index/_all/`) and rebuilds it from the run records when they disagree. A
bucket that has runs from before the database (no snapshot yet) is rebuilt on its first run:
trigger it once after upgrading.

One run at a time: two compactions at once could write back a snapshot that lacks what the
other deleted. Schedule: `KUBETRAIN_RUN_INDEX_CRON` (default daily; empty: manual only). By
hand: `python -m kubetrain.store.rebuild_index` (`--check`, `--compact`).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, task

from kubetrain import DEFAULT_ARGS, environ


@dag(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=environ("KUBETRAIN_RUN_INDEX_CRON", "@daily") or None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "maintenance"],
)
def kubetrain_run_index():
    @task(max_active_tis_per_dag=1)
    def maintain() -> dict:
        """Compact the run index database, check it against index/_all/, rebuild it when needed."""
        import dataclasses

        from kubetrain import maintain_run_index

        done = maintain_run_index()
        print(done.line(), flush=True)
        return dataclasses.asdict(done)

    maintain()


kubetrain_run_index()
