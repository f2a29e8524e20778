"""Run records: ``<run>/run-record.json`` and its copies in the run indexes and the leaderboards."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import RunLocation, s3_uri
from kubetrain_contract.run import RunRecord

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore


class RunRepository:
    """The run records of finished runs and their index copies, in the training bucket.

    :param store: the S3 gateway.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.layout = store.layout

    def get(self, run: RunLocation) -> dict[str, Any] | None:
        """The record of a run as stored, or ``None`` when it has none.

        The document is returned as it is (the pages read records of every format version);
        ``RunRecord.from_dict`` reads it as a record.
        """
        record = self.store.read_json(run.bucket, self.layout.run_record_key(run))
        return record if isinstance(record, dict) else None

    def write(self, record: RunRecord | Mapping[str, Any]) -> str:
        """Write a run record and its index copies; return the record's URI.

        Writing the same run again (a retried record step, a cleared and re-run DAG run) replaces
        its index entries: the copies of the previous record under other names (another status,
        value or dataset version) are deleted after the new ones are written, so the run is
        never missing from the indexes and never listed twice. Last, a delta object of the run
        index database (:mod:`kubetrain.store.runs_db`): its key is this write's own, so
        concurrent writers never lose each other's entries; the first record of an empty index
        also puts the database's empty snapshot.

        :param record: the record, or its document (read, and so checked, as a :class:`RunRecord`).
        :raises RecordError: the document is not a valid run record.
        """
        from kubetrain.store.index import index_name, record_keys
        from kubetrain.store.runs_db import start_if_empty, write_delta

        if not isinstance(record, RunRecord):
            record = RunRecord.from_dict(dict(record))
        run = RunLocation.from_uri(record.run_uri)
        bucket = self.layout.training_bucket
        if run.bucket != bucket:
            raise ValueError(
                f"run {run.uri} is not in the training bucket {bucket}: its record would not be indexed"
            )
        previous = self.get(run)
        if previous is None:
            start_if_empty(self.store)
        keys = record_keys(self.layout, record)
        body = (record.to_json(indent=1) + "\n").encode()
        # The run's own key last: a reader of the previous record still finds its stale copies to delete.
        for key in [*keys[1:], keys[0]]:
            self.store.write(bucket, key, body, content_type="application/json")
        if previous is not None:
            try:
                stale = set(record_keys(self.layout, RunRecord.from_dict(previous))) - set(keys)
            except (KeyError, ValueError, TypeError):
                stale = set()  # a record of an older format: its copies cannot be named
            if stale:
                self.store.delete(bucket, sorted(stale))
        write_delta(self.store, record, index_name(record))
        return s3_uri(bucket, keys[0])
