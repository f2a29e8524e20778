"""Check, rebuild or compact the run index database (:mod:`kubetrain.store.runs_db`).

``python -m kubetrain.store.rebuild_index``: a new snapshot from the run records (when the
database and the records disagree, or for an index that has runs from before the database);
``--check``: compare the database with the key-named index, exit 1 when they disagree;
``--compact``: fold the deltas into the snapshot and delete the folded ones.

S3 is reached through Airflow's ``aws_default`` connection, the bucket is the deployment's
(:meth:`S3Layout.from_environment`). :func:`maintain_run_index` is the ``kubetrain_run_index`` DAG's task.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore
    from kubetrain.store.runs_db import Maintenance


def deployment_store(training_bucket: str | None = None) -> RunStore:
    """The deployment's run store: its training bucket (or ``training_bucket``) through ``aws_default``."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from kubetrain.run_store import RunStore
    from kubetrain.s3_layout import S3Layout

    return RunStore(
        S3Hook(aws_conn_id="aws_default", config={"max_pool_connections": 16}),
        S3Layout.from_environment(training_bucket=training_bucket),
    )


def maintain_run_index() -> Maintenance:
    """The run index database's upkeep in the deployment's training bucket (:func:`runs_db.maintain
    <kubetrain.store.runs_db.maintain>`): compacted, checked against ``index/_all/``, rebuilt when they
    disagree."""
    from kubetrain.store import runs_db

    return runs_db.maintain(deployment_store())


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit status.

    :param argv: the arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(prog="python -m kubetrain.store.rebuild_index", description=__doc__)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="compare the database with index/_all/")
    what.add_argument("--compact", action="store_true", help="fold the deltas into the snapshot")
    parser.add_argument("--bucket", help="the training bucket (default: the deployment's)")
    args = parser.parse_args(argv)

    from kubetrain.store import runs_db

    store = deployment_store(args.bucket)
    started = time.monotonic()
    if args.check:
        found = runs_db.check(store)
        for name in found.missing[:20]:
            print(f"missing from the database: {name}")
        for name in found.extra[:20]:
            print(f"in the database, not in index/_all/: {name}")
        print(
            f"{len(found.missing)} missing, {len(found.extra)} extra"
            + (": they agree" if found.agree else ": run this command without --check to rebuild")
        )
        return 0 if found.agree else 1
    db = runs_db.compact(store) if args.compact else runs_db.rebuild(store)
    print(
        f"{'compacted' if args.compact else 'rebuilt'} s3://{store.layout.training_bucket}/{runs_db.SNAPSHOT_KEY}:"
        f" {db.count()} runs in {time.monotonic() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
