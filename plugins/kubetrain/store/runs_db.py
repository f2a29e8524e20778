"""The run index as an SQLite database: what the Training page's runs list and filters query.

The key-named run index (:mod:`kubetrain.store.index`) answers "newest first" with one LIST, but a
filter must walk its keys (1,000 per request) and the page must GET each record it shows. This
module keeps the same entries in an embedded SQLite database (stdlib :mod:`sqlite3`, one table,
an index per filter column followed by the entry name), with each run's record document stored
compressed beside its filter columns, so a page of any filter is one local query.

Where it lives, in the training bucket, below ``index/_db/`` (``_db`` is no model name: model
names start with a letter or digit):

* ``index/_db/compacted/runs.sqlite``: the snapshot, a whole database (``sqlite3`` ``serialize``);
  its ``meta`` table says up to which delta it is folded (``deltas_through``, epoch milliseconds);
* ``index/_db/deltas/<inverted write time>~<random>.json``: one small object per record written,
  ``{"entry": <index entry name>, "written": <epoch ms>, "record": <run record document>}``.
  Inverted times sort newest first, so a reader lists only the head of the prefix.

Keeping it in step, without lost updates: the record step (:meth:`RunRepository.write`) writes
the run record and its index copies as before, then its own delta object. Each write has a key of
its own: no read-modify-write of a shared object, so any number of Airflow workers write at once
and none overwrites another's entry. A run written twice (a retried record step) has two deltas;
rows are keyed by the run's reference (``<dag>/<run>[/trials/<trial>]``) and an upsert only
replaces a row with a delta written later (``written``), so folding deltas in any order, or
twice, gives the same table. In an empty index the first write also puts an empty snapshot, so
a new deployment's page is served by the database from the first run on; an index that has
runs from before this database has no snapshot until :func:`rebuild` makes one.

Reading: the API server keeps one :class:`RunsIndex` per bucket, the database in memory. Each
refresh is one ListObjectsV2 of ``index/_db/`` (``compacted/`` sorts before ``deltas/``, so the
same list returns the snapshot's ETag and the newest deltas): a changed ETag reloads the
snapshot (one GET); deltas newer than ``deltas_through`` minus :data:`GRACE_MS` that the
database has not folded are read (one GET each, in parallel: a page that has been idle for a
while pays for the runs recorded meanwhile, a busy page one list). The grace window catches a
delta that lands late (a slow PUT, a writer's clock behind): the folded keys of the window are
remembered, so they are read once.

Compaction (:func:`compact`, ``python -m kubetrain.store.rebuild_index --compact``) writes the
reader's folded database back as the snapshot and deletes the deltas it holds that are older
than the grace window, so a fresh API server reads one object plus a few deltas. Run one
compaction at a time: two at once could write back a snapshot that lacks what the other
deleted. The ``kubetrain_run_index`` DAG (daily, one run at a time) does it: :func:`maintain`
rebuilds when there is no readable snapshot (a new deployment's bucket that has runs from
before this database), else compacts and checks, and rebuilds when they disagree.

When the index and the records disagree (a delta lost to a crash between the record and its
delta, an object edited by hand, a snapshot from a bug): the per-run records and their key-named
index stay the source of truth. :func:`check` compares the database with the keys of
``index/_all/``; :func:`rebuild` (``python -m kubetrain.store.rebuild_index``) lists those keys,
reads every run's own ``run-record.json`` and writes a new snapshot; deltas written while it runs
are newer than its rows and still fold. Without a snapshot, or when the snapshot cannot be read,
the page falls back to walking the keys (today's bounded scan, with its "search on" notice) and
the JSON answer says ``"source": "keys"``.
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kubetrain.store.index import SEPARATOR, IndexEntry
from kubetrain_contract.run_layout import RUN_RECORD_JSON

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore
    from kubetrain_contract.run import RunRecord

log = logging.getLogger(__name__)

DB_PREFIX = "index/_db/"
SNAPSHOT_KEY = DB_PREFIX + "compacted/runs.sqlite"
DELTA_PREFIX = DB_PREFIX + "deltas/"
# A delta that lands up to this late (a slow PUT, a clock behind) is still folded.
GRACE_MS = 10 * 60 * 1000
LIST_PAGE = 1000
_CEILING = 10**13 - 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    ref TEXT PRIMARY KEY,          -- <dag>/<run>[/trials/<trial>] (S3-safe segments)
    entry TEXT NOT NULL,           -- the run's name in the key-named run index: the page's order
    model TEXT NOT NULL,
    dag TEXT NOT NULL,
    dataset_version TEXT NOT NULL,
    status TEXT NOT NULL,
    written INTEGER NOT NULL,      -- epoch ms of the write this row comes from
    doc BLOB NOT NULL              -- the run record document, compact JSON, zlib
);
CREATE INDEX IF NOT EXISTS runs_entry ON runs (entry);
CREATE INDEX IF NOT EXISTS runs_model ON runs (model, entry);
CREATE INDEX IF NOT EXISTS runs_dag ON runs (dag, entry);
CREATE INDEX IF NOT EXISTS runs_version ON runs (dataset_version, entry);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status, entry);
CREATE TABLE IF NOT EXISTS folded (key TEXT PRIMARY KEY);  -- delta keys of the grace window
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class IndexUnavailable(RuntimeError):
    """The run index database cannot answer (no snapshot yet, or it cannot be read)."""


def now_ms() -> int:
    return int(time.time() * 1000)


def delta_key(written_ms: int) -> str:
    """A delta's key: newest first, unique per write (``written_ms``: epoch milliseconds)."""
    return f"{DELTA_PREFIX}{_CEILING - written_ms:013d}{SEPARATOR}{secrets.token_hex(6)}.json"


def delta_time(key: str) -> int | None:
    """Epoch milliseconds of a delta key, or ``None`` when ``key`` is not a delta's."""
    name = key[len(DELTA_PREFIX) :] if key.startswith(DELTA_PREFIX) else ""
    stamp = name.split(SEPARATOR, 1)[0]
    return _CEILING - int(stamp) if len(stamp) == 13 and stamp.isdigit() else None


def _ref(entry: IndexEntry) -> str:
    return f"{entry.dag}/{entry.run}" + (f"/trials/{entry.trial}" if entry.trial else "")


@dataclass(frozen=True)
class Query:
    """A runs-list query: the filters (``None``: any), the readable DAG segments, ``after`` an entry name."""

    readable: frozenset[str]
    model: str | None = None
    dag: str | None = None
    dataset_version: str | None = None
    status: str | None = None
    after: str | None = None
    limit: int = 50


class RunsDb:
    """The run index database (one SQLite connection; the caller serialises access).

    :param data: a serialised database (a snapshot's bytes) to open; ``None``: a new, empty one.
    """

    def __init__(self, data: bytes | None = None) -> None:
        self.conn = sqlite3.connect(":memory:", check_same_thread=False)
        if data is not None:
            try:
                self.conn.deserialize(data)
                self.conn.execute("SELECT count(*) FROM runs").fetchone()
            except sqlite3.DatabaseError as exc:
                raise IndexUnavailable(f"the run index snapshot is not a database of runs: {exc}") from exc
        self.conn.executescript(SCHEMA)

    # -- writing -------------------------------------------------------------------------------

    def upsert(self, entry_name: str, record: Mapping[str, Any], written: int) -> bool:
        """Put a run's row unless a later write of the same run is there; return whether it changed.

        :param entry_name: the run's name in the key-named index (``<inverted time>~<model>~...json``).
        :param record: the run record document.
        :param written: epoch ms of the write (a delta's time; a rebuild's start).
        """
        entry = IndexEntry.parse(entry_name)
        doc = zlib.compress(json.dumps(record, separators=(",", ":"), default=str).encode(), 6)
        cursor = self.conn.execute(
            "INSERT INTO runs (ref, entry, model, dag, dataset_version, status, written, doc)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (ref) DO UPDATE SET entry = excluded.entry, model = excluded.model,"
            " dag = excluded.dag, dataset_version = excluded.dataset_version, status = excluded.status,"
            " written = excluded.written, doc = excluded.doc WHERE excluded.written >= runs.written",
            (
                _ref(entry),
                entry_name.rsplit("/", 1)[-1],
                entry.model,
                entry.dag,
                entry.dataset_version,
                entry.status,
                written,
                doc,
            ),
        )
        return cursor.rowcount > 0

    def get_meta(self, name: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None

    def set_meta(self, name: str, value: str) -> None:
        self.conn.execute(
            "INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            (name, value),
        )

    @property
    def deltas_through(self) -> int:
        """Epoch ms of the newest delta folded in (0: none)."""
        return int(self.get_meta("deltas_through") or 0)

    def serialize(self) -> bytes:
        """The database as bytes (a snapshot), with fresh statistics for the query planner (``ANALYZE``)."""
        self.conn.execute("ANALYZE")
        self.conn.commit()
        return self.conn.serialize()

    # -- reading -------------------------------------------------------------------------------

    def runs(self, query: Query) -> tuple[list[tuple[str, dict[str, Any]]], bool]:
        """``(entry name, record)`` of up to ``query.limit`` runs newest first, and whether more match."""
        # "+dag": the readable DAGs filter rows but choose no index (else the first page would read every
        # readable run through runs_dag and sort them); a filter's own columns choose it
        where, args = ["+dag IN (SELECT value FROM json_each(?))"], [json.dumps(sorted(query.readable))]
        for column, value in (
            ("model", query.model),
            ("dag", query.dag),
            ("dataset_version", query.dataset_version),
            ("status", query.status),
        ):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if query.after is not None:
            where.append("entry > ?")
            args.append(query.after)
        rows = self.conn.execute(
            f"SELECT entry, doc FROM runs WHERE {' AND '.join(where)} ORDER BY entry LIMIT ?",  # noqa: S608
            [*args, query.limit + 1],
        ).fetchall()
        found = [(entry, json.loads(zlib.decompress(doc))) for entry, doc in rows[: query.limit]]
        return found, len(rows) > query.limit

    def models(self, readable: Iterable[str]) -> list[str]:
        """Models with a run of a readable DAG (a skip scan of the model index: one probe per model)."""
        dags = json.dumps(sorted(readable))
        names: list[str] = []
        last = ""
        while True:
            row = self.conn.execute(
                "SELECT model FROM runs WHERE model > ? ORDER BY model LIMIT 1", (last,)
            ).fetchone()
            if row is None:
                return names
            last = row[0]
            seen = self.conn.execute(
                "SELECT 1 FROM runs WHERE model = ? AND dag IN (SELECT value FROM json_each(?)) LIMIT 1",
                (last, dags),
            ).fetchone()
            if seen:
                names.append(last)

    def has_model(self, model: str, readable: Iterable[str]) -> bool:
        row = self.conn.execute(
            "SELECT 1 FROM runs WHERE model = ? AND dag IN (SELECT value FROM json_each(?)) LIMIT 1",
            (model, json.dumps(sorted(readable))),
        ).fetchone()
        return row is not None

    def entries(self) -> set[str]:
        """Every run's entry name."""
        return {row[0] for row in self.conn.execute("SELECT entry FROM runs")}

    def count(self) -> int:
        return self.conn.execute("SELECT count(*) FROM runs").fetchone()[0]


# -- the record step's side ----------------------------------------------------------------------


def empty_snapshot() -> bytes:
    return RunsDb().serialize()


def start_if_empty(store: RunStore) -> None:
    """Put an empty snapshot when the run index has no entry at all (a new deployment's first run).

    Two short lists: ``index/_db/`` (it has a snapshot or deltas: nothing to do), then ``index/_all/``
    (runs from before the database: they wait for :func:`rebuild`); never a list of all of ``index/``.
    """
    bucket = store.layout.training_bucket
    client = store.hook.conn
    for prefix in (DB_PREFIX, store.layout.run_index_prefix(None)):
        if client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0):
            return
    store.write(bucket, SNAPSHOT_KEY, empty_snapshot(), content_type="application/vnd.sqlite3")


def write_delta(store: RunStore, record: RunRecord, entry_name: str) -> str:
    """Write the delta of a record just written (after its index copies); return its key."""
    written = now_ms()
    key = delta_key(written)
    body = {"entry": entry_name, "written": written, "record": json.loads(record.to_json(indent=None))}
    store.write(
        store.layout.training_bucket,
        key,
        json.dumps(body, separators=(",", ":")).encode(),
        content_type="application/json",
    )
    return key


# -- the page's side -------------------------------------------------------------------------------


@dataclass
class _Listing:
    snapshot_etag: str | None = None
    deltas: list[str] = field(default_factory=list)  # newest first, within the window


class RunsIndex:
    """The run index database of one training bucket, cached in this process and refreshed per request.

    :param store: the run store; only its hook's boto3 client is used (the list and the GETs), which
        the API server's threads may share.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.bucket = store.layout.training_bucket
        self.lock = threading.Lock()
        self.db: RunsDb | None = None
        self.etag: str | None = None
        self.problem: str | None = None

    def _list(self, since: int) -> _Listing:
        """One ListObjectsV2 of ``index/_db/`` (more only while deltas newer than ``since`` fill the pages)."""
        client = self.store.hook.conn
        listing = _Listing()
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": DB_PREFIX, "MaxKeys": LIST_PAGE}
        while True:
            answer = client.list_objects_v2(**args)
            contents = answer.get("Contents", [])
            for item in contents:
                key = item["Key"]
                if key == SNAPSHOT_KEY:
                    listing.snapshot_etag = item.get("ETag")
                    continue
                written = delta_time(key)
                if written is None:
                    continue
                if written < since:
                    return listing
                listing.deltas.append(key)
            if not answer.get("IsTruncated") or not contents:
                return listing
            args["StartAfter"] = contents[-1]["Key"]

    def refresh(self) -> RunsDb:
        """Bring the cached database up to date; :class:`IndexUnavailable` when there is none to use."""
        from kubetrain.run_store import is_missing_key

        with self.lock:
            since = self.db.deltas_through - GRACE_MS if self.db is not None else 0
            listing = self._list(since)
            if listing.snapshot_etag is None:
                self.db, self.etag = None, None
                self.problem = "the run index database has no snapshot yet"
                raise IndexUnavailable(self.problem)
            if listing.snapshot_etag != self.etag or self.db is None:
                # the boto3 client, not the hook's resource: threads share this index (and its store)
                try:
                    data = self.store.hook.conn.get_object(Bucket=self.bucket, Key=SNAPSHOT_KEY)[
                        "Body"
                    ].read()
                except Exception as exc:
                    if is_missing_key(exc):
                        raise IndexUnavailable(
                            "the run index snapshot disappeared while it was read"
                        ) from None
                    raise
                try:
                    db = RunsDb(data)
                except IndexUnavailable as exc:
                    self.db, self.problem = None, str(exc)
                    raise
                self.db, self.etag = db, listing.snapshot_etag
                since = db.deltas_through - GRACE_MS
                listing.deltas = [k for k in listing.deltas if (delta_time(k) or 0) >= since]
            self._fold(self.db, listing.deltas)
            self.problem = None
            return self.db

    def _fold(self, db: RunsDb, keys: list[str]) -> None:
        folded = {
            row[0]
            for row in db.conn.execute(
                "SELECT key FROM folded WHERE key IN (SELECT value FROM json_each(?))", (json.dumps(keys),)
            )
        }
        todo = [k for k in keys if k not in folded]
        if not todo:
            return
        documents = self.store.read_many(self.bucket, todo)
        newest = db.deltas_through
        for key, document in zip(todo, documents, strict=True):
            written = delta_time(key) or 0
            if isinstance(document, dict):
                try:
                    db.upsert(document["entry"], document["record"], int(document.get("written", written)))
                except (KeyError, TypeError, ValueError) as exc:
                    log.warning("run index delta %s is not usable, skipped: %s", key, exc)
            db.conn.execute("INSERT OR IGNORE INTO folded (key) VALUES (?)", (key,))
            newest = max(newest, written)
        db.set_meta("deltas_through", str(newest))
        # forget the folded keys that no list will return again
        db.conn.execute(
            "DELETE FROM folded WHERE key > ?", (f"{DELTA_PREFIX}{_CEILING - (newest - 2 * GRACE_MS):013d}",)
        )
        db.conn.commit()


_CACHE: dict[tuple[str, str], RunsIndex] = {}
_CACHE_LOCK = threading.Lock()


def cached_index(store: RunStore, endpoint: str = "") -> RunsIndex:
    """This process's :class:`RunsIndex` of the store's training bucket (one per S3 endpoint and bucket).

    :param endpoint: what tells S3 servers apart (the connection's endpoint URL).
    """
    key = (endpoint, store.layout.training_bucket)
    with _CACHE_LOCK:
        index = _CACHE.get(key)
        if index is None:
            index = _CACHE[key] = RunsIndex(store)
        return index


# -- maintenance ---------------------------------------------------------------------------------


def _delete_deltas_before(store: RunStore, before_ms: int) -> int:
    bucket = store.layout.training_bucket
    stale = [k for k in store.list_keys(bucket, DELTA_PREFIX) if (delta_time(k) or before_ms) < before_ms]
    for start in range(0, len(stale), 1000):
        store.delete(bucket, stale[start : start + 1000])
    return len(stale)


def rebuild(store: RunStore, *, workers: int = 16) -> RunsDb:
    """A new snapshot from the records: every entry of ``index/_all/``, its run's own ``run-record.json``.

    Rows carry the rebuild's start time: deltas written after it are newer and still fold; those
    written before it are in the records read, and are deleted once older than the grace window.
    """
    bucket = store.layout.training_bucket
    started = now_ms()
    db = RunsDb()
    # the deltas written so far are in the records read below: a reader need not read them again
    recent = [k for k in store.list_keys(bucket, DELTA_PREFIX) if (delta_time(k) or 0) >= started - GRACE_MS]
    db.conn.executemany("INSERT OR IGNORE INTO folded (key) VALUES (?)", [(k,) for k in recent])
    entries = []
    for key in store.list_keys(bucket, store.layout.run_index_prefix(None)):
        try:
            entries.append(IndexEntry.parse(key))
        except ValueError:
            continue
    for start in range(0, len(entries), 1000):
        chunk = entries[start : start + 1000]
        records = store.read_many(
            bucket, [f"runs/{_ref(e)}/{RUN_RECORD_JSON}" for e in chunk], workers=workers
        )
        for entry, record in zip(chunk, records, strict=True):
            if isinstance(record, dict):
                db.upsert(entry.key, record, started)
    db.set_meta("deltas_through", str(started))
    db.set_meta("rebuilt_at", str(started))
    store.write(bucket, SNAPSHOT_KEY, db.serialize(), content_type="application/vnd.sqlite3")
    _delete_deltas_before(store, started - GRACE_MS)
    return db


def compact(store: RunStore) -> RunsDb:
    """Write the folded database back as the snapshot; delete the deltas it holds beyond the grace window."""
    index = RunsIndex(store)
    db = index.refresh()
    store.write(
        store.layout.training_bucket, SNAPSHOT_KEY, db.serialize(), content_type="application/vnd.sqlite3"
    )
    _delete_deltas_before(store, db.deltas_through - GRACE_MS)
    return db


@dataclass
class Disagreement:
    """Entries of ``index/_all/`` the database lacks, and rows the key index lacks."""

    missing: list[str]
    extra: list[str]

    @property
    def agree(self) -> bool:
        return not self.missing and not self.extra


def check(store: RunStore) -> Disagreement:
    """Compare the database (refreshed) with the keys of ``index/_all/`` (one LIST per 1,000 runs)."""
    db = RunsIndex(store).refresh()
    prefix = store.layout.run_index_prefix(None)
    keys = {k[len(prefix) :] for k in store.list_keys(store.layout.training_bucket, prefix)}
    rows = db.entries()
    return Disagreement(sorted(keys - rows), sorted(rows - keys))


@dataclass
class Maintenance:
    """What :func:`maintain` did.

    :param action: ``"rebuilt"`` or ``"compacted"``.
    :param reason: why, in words.
    :param runs: the runs the snapshot holds now.
    :param missing: runs of ``index/_all/`` the compacted database lacked (then rebuilt).
    :param extra: rows of the compacted database that ``index/_all/`` lacked (then rebuilt).
    """

    action: str
    reason: str
    runs: int
    missing: int = 0
    extra: int = 0

    def line(self) -> str:
        """One line for a task log."""
        return f"Run index database {self.action}: {self.runs} runs ({self.reason})"


def maintain(store: RunStore) -> Maintenance:
    """The run index database's upkeep, one run at a time (the ``kubetrain_run_index`` DAG).

    Without a readable snapshot (a bucket whose runs were recorded before this database, or a
    snapshot that is no database): :func:`rebuild` from the records. Otherwise :func:`compact`,
    then :func:`check` against ``index/_all/``, and :func:`rebuild` when they disagree (a delta
    lost between a record and its delta; a record step still between its index copies and its
    delta also shows as missing, and costs only an unneeded rebuild).
    """
    try:
        db = compact(store)
    except IndexUnavailable as exc:
        db = rebuild(store)
        return Maintenance("rebuilt", f"{exc}: rebuilt from the run records", db.count())
    found = check(store)
    if found.agree:
        return Maintenance("compacted", "it agrees with index/_all/", db.count())
    db = rebuild(store)
    return Maintenance(
        "rebuilt",
        f"{len(found.missing)} run(s) of index/_all/ were missing from it and {len(found.extra)} row(s) "
        "were not in index/_all/: rebuilt from the run records",
        db.count(),
        len(found.missing),
        len(found.extra),
    )
