"""What the Training page shows, read from the run index in S3 for one viewer.

Every query takes the set of DAG ids the viewer may read (the Airflow auth manager's answer)
and never returns, reads or names a run of another DAG. The runs list and its filters are
answered by the run index database (:mod:`kubetrain.store.runs_db`) when the API server has
one: one local query, its records included, after one S3 list that keeps it in step. Without
it (no snapshot yet, or one that cannot be read) lists read keys (the run index's names carry
model, DAG, run, trial, dataset version and status) and fetch only the records a page shows,
in parallel, a filter reading at most :data:`MAX_SCAN` keys per request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import check_name, check_version, safe_segment
from kubetrain.store.index import IndexEntry, LeaderboardEntry, inverted_time, run_time_of
from kubetrain_contract.run_layout import RUN_RECORD_JSON

if TYPE_CHECKING:
    from kubetrain.report.inputs import History
    from kubetrain.run_store import RunStore
    from kubetrain.store.runs_db import RunsDb, RunsIndex

PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
SCAN_CHUNK = 1000
# A filtered list reads at most this many index keys per request (5 ListObjectsV2 requests), then
# offers to search on from where it stopped: a rare filter never makes one request slow.
MAX_SCAN = 5000
COMPARE_MIN, COMPARE_MAX = 2, 5
_REF = re.compile(
    r"^(?P<dag>[A-Za-z0-9._-]+)/(?P<run>[A-Za-z0-9._-]+)(?:/trials/(?P<trial>[A-Za-z0-9._-]+))?$"
)


class QueryError(ValueError):
    """A filter or a selection that cannot be answered; the message names the value and what was expected."""


class NotVisible(LookupError):
    """The run does not exist or the viewer may not read its DAG (the two are not told apart)."""


class ModelNotVisible(QueryError):
    """The model has no run the viewer may read, or does not exist (the two are not told apart)."""


@dataclass(frozen=True)
class RunFilter:
    """The runs list's filters; every field optional."""

    model: str | None = None
    dag_id: str | None = None
    dataset_version: str | None = None
    status: str | None = None

    def __post_init__(self) -> None:
        try:
            if self.model:
                check_name("model", self.model)
            if self.dataset_version:
                check_version(self.dataset_version)
        except ValueError as exc:
            raise QueryError(str(exc)) from None
        if self.status and self.status not in ("success", "failed"):
            raise QueryError(f"status {self.status!r} is not valid: expected success or failed")

    def matches(self, entry: IndexEntry) -> bool:
        if self.dag_id and entry.dag != safe_segment(self.dag_id):
            return False
        if self.dataset_version and entry.dataset_version != self.dataset_version:
            return False
        return not self.status or entry.status == self.status


def run_ref(dag: str, run: str, trial: str = "") -> str:
    """A run's reference in URLs: its prefix below ``runs/`` (S3-safe segments)."""
    return f"{dag}/{run}" + (f"/trials/{trial}" if trial else "")


def record_ref(record: dict[str, Any]) -> str:
    trial = record.get("trial")
    return run_ref(
        safe_segment(record["dag_id"]),
        safe_segment(record["run_id"]),
        safe_segment(str(trial)) if trial not in (None, "") else "",
    )


def parse_ref(ref: str) -> tuple[str, str, str]:
    """``(dag segment, run segment, trial segment)`` of a run reference."""
    match = _REF.match(ref or "")
    if not match or any(part in (".", "..") for part in ref.split("/")):
        raise QueryError(
            f"run reference {ref!r} is not valid: expected <dag>/<run> or <dag>/<run>/trials/<trial>"
        )
    return match.group("dag"), match.group("run"), match.group("trial") or ""


@dataclass
class RunsPage:
    """One page of runs; ``next_after`` continues it (``None``: no older run matches).

    ``scanned`` index keys were read; ``searched_all`` is false when the scan stopped at
    :data:`MAX_SCAN` keys before the page was full (then ``next_after`` searches on).
    ``source`` says what answered: ``"db"`` the run index database (always complete), ``"keys"``
    the key walk.
    """

    runs: list[dict[str, Any]]
    next_after: str | None
    scanned: int = 0
    searched_all: bool = True
    source: str = "keys"


@dataclass
class Leaderboard:
    model: str
    metric: str | None
    mode: str | None
    metrics: list[str]
    entries: list[dict[str, Any]]
    promoted: dict[str, Any] | None


@dataclass
class Comparison:
    runs: list[dict[str, Any]]
    histories: list[History | None]
    params: list[dict[str, Any]] = field(default_factory=list)


class TrainingQueries:
    """The Training page's reads for one viewer.

    :param store: the run store (the API server's S3 connection).
    :param readable_dags: DAG ids the viewer may read.
    :param index: the process's run index database; ``None``: lists walk the index keys.
    """

    def __init__(self, store: RunStore, readable_dags: Iterable[str], index: RunsIndex | None = None) -> None:
        self.store = store
        self.bucket = store.layout.training_bucket
        self.dag_ids = sorted(readable_dags)
        self.readable = {safe_segment(d) for d in self.dag_ids}
        self.index = index
        self._db: RunsDb | None = None
        self._db_tried = False

    def db(self) -> RunsDb | None:
        """The run index database brought up to date (once per request), or ``None`` to walk the keys."""
        from kubetrain.store.runs_db import IndexUnavailable

        if self.index is not None and not self._db_tried:
            self._db_tried = True
            try:
                self._db = self.index.refresh()
            except IndexUnavailable:
                self._db = None
        return self._db

    # -- runs ----------------------------------------------------------------------------------

    def _entries(self, prefix: str, after: str | None, first: int = SCAN_CHUNK) -> Iterator[IndexEntry]:
        """Index entries under ``prefix`` after the key ``after``: ``first`` keys, then 1000 per request."""
        chunk = first
        while True:
            keys = self.store.list_keys(self.bucket, prefix, start_after=after, max_keys=chunk)
            for key in keys:
                try:
                    yield IndexEntry.parse(key)
                except ValueError:
                    continue  # not an entry of this format
            if len(keys) < chunk:
                return
            after, chunk = keys[-1], SCAN_CHUNK

    def runs(
        self, filt: RunFilter, *, after: str | None = None, limit: int = PAGE_SIZE, max_scan: int = MAX_SCAN
    ) -> RunsPage:
        """Runs newest first (by the DAG run's time), ``limit`` of them after the index key ``after``."""
        if not 1 <= limit <= MAX_PAGE_SIZE:
            raise QueryError(f"limit={limit} is not valid: expected 1 to {MAX_PAGE_SIZE}")
        prefix = self.store.layout.run_index_prefix(filt.model or None)
        if after is not None and not after.startswith(prefix):
            raise QueryError(f"after={after!r} is not a key of the run index {prefix}")
        db = self.db()
        if db is not None:
            return self._runs_from_db(db, filt, prefix, after, limit)
        picked: list[IndexEntry] = []
        more = False
        scanned = 0
        last: str | None = None
        # Without filters on the keys nearly every key is a row: list one page's worth first.
        first = limit + 1 if not (filt.dag_id or filt.dataset_version or filt.status) else SCAN_CHUNK
        for entry in self._entries(prefix, after, first):
            if scanned == max_scan:
                break
            scanned += 1
            last = entry.key
            if entry.dag not in self.readable or not filt.matches(entry):
                continue
            if len(picked) == limit:
                more = True
                break
            picked.append(entry)
        else:
            last = None  # the index ends here
        stopped = scanned == max_scan and not more and last is not None
        records = self.store.read_many(self.bucket, [e.key for e in picked])
        runs = [self._row(r, e.key) for r, e in zip(records, picked, strict=True) if isinstance(r, dict)]
        if more:
            return RunsPage(runs, picked[-1].key, scanned)
        return RunsPage(runs, last if stopped else None, scanned, searched_all=not stopped)

    def _runs_from_db(
        self, db: RunsDb, filt: RunFilter, prefix: str, after: str | None, limit: int
    ) -> RunsPage:
        from kubetrain.store.runs_db import Query

        query = Query(
            readable=frozenset(self.readable),
            model=filt.model or None,
            dag=safe_segment(filt.dag_id) if filt.dag_id else None,
            dataset_version=filt.dataset_version or None,
            status=filt.status or None,
            after=after[len(prefix) :] if after is not None else None,
            limit=limit,
        )
        with self.index.lock:  # type: ignore[union-attr]  # one query at a time on the shared connection
            found, more = db.runs(query)
        runs = [self._row(record, prefix + entry) for entry, record in found]
        next_after = prefix + found[-1][0] if more and found else None
        return RunsPage(runs, next_after, len(runs), searched_all=True, source="db")

    def _row(self, record: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        record = dict(record)
        record["ref"] = record_ref(record)
        record["index_key"] = key
        return record

    def models(self) -> list[str]:
        """Models that have runs of a DAG the viewer may read in the index (other teams' model names stay hidden)."""
        db = self.db()
        if db is not None:
            with self.index.lock:  # type: ignore[union-attr]
                return db.models(self.readable)
        prefixes = self.store.list_prefixes(self.bucket, "index/")
        names = [p[len("index/") :].rstrip("/") for p in prefixes]
        # index/_all/ and index/_db/ (the database) are no model's: model names start with a letter or digit
        return sorted(n for n in names if n and not n.startswith("_") and self.model_readable(n))

    def training_dags(self) -> list[str]:
        """The readable DAGs that train: those with a run record in the index (build, preflight and
        maintenance DAGs write none), for the runs list's DAG filter.

        The run index database answers with one probe per DAG; without it, the DAG folders of the
        training bucket's ``runs/`` (one LIST) stand in, as every training run writes below them.
        """
        db = self.db()
        if db is not None:
            with self.index.lock:  # type: ignore[union-attr]
                found = _dags_of(db, self.readable)
        else:
            found = {p[len("runs/") :].rstrip("/") for p in self.store.list_prefixes(self.bucket, "runs/")}
        return [d for d in self.dag_ids if safe_segment(d) in found]

    def model_readable(self, model: str) -> bool:
        """Whether ``model`` has a run of a readable DAG in its index (the first ``MAX_SCAN`` entries decide)."""
        db = self.db()
        if db is not None:
            with self.index.lock:  # type: ignore[union-attr]
                return db.has_model(model, self.readable)
        for scanned, entry in enumerate(self._entries(self.store.layout.run_index_prefix(model), None)):
            if entry.dag in self.readable:
                return True
            if scanned + 1 == MAX_SCAN:
                break
        return False

    def _check_model(self, model: str) -> None:
        """A model the viewer may not see is answered as one that does not exist."""
        try:
            check_name("model", model)
        except ValueError as exc:
            raise QueryError(str(exc)) from None
        if not self.model_readable(model):
            raise ModelNotVisible(f"no model {model} that you may read")

    # -- one model -----------------------------------------------------------------------------

    def leaderboard(self, model: str, *, metric: str | None = None, limit: int = PAGE_SIZE) -> Leaderboard:
        """The model's successful runs best first on ``metric`` (default: the promoted version's objective); the
        promoted pointer only when the viewer may read the run it names."""
        self._check_model(model)
        layout = self.store.layout
        base = layout.leaderboard_prefix(model)
        metrics = sorted(p[len(base) :].rstrip("/") for p in self.store.list_prefixes(self.bucket, base))
        pointer = self.store.models.pointer(model)
        promoted_record = self._promoted_record(pointer)
        if promoted_record is None:
            pointer = None  # it names a run (its URI, its DAG) the viewer may not read
        if metric is None:
            wanted = ((promoted_record or {}).get("metrics") or {}).get("monitor")
            metric = (
                safe_segment(wanted)
                if wanted and safe_segment(wanted) in metrics
                else (metrics[0] if metrics else None)
            )
        elif safe_segment(metric) not in metrics:
            raise QueryError(
                f"model {model} has no leaderboard for metric {metric!r}: it has {', '.join(metrics) or 'none'}"
            )
        if metric is None:
            return Leaderboard(model, None, None, metrics, [], pointer)
        prefix = layout.leaderboard_prefix(model, metric)
        keys: list[str] = []
        after: str | None = None
        while len(keys) < limit:
            chunk = self.store.list_keys(self.bucket, prefix, start_after=after, max_keys=SCAN_CHUNK)
            keys += [k for k in chunk if _leaderboard_dag(k) in self.readable][: limit - len(keys)]
            if len(chunk) < SCAN_CHUNK:
                break
            after = chunk[-1]
        records = [r for r in self.store.read_many(self.bucket, keys) if isinstance(r, dict)]
        mode = records[0]["metrics"]["monitor_mode"] if records else None
        version = (pointer or {}).get("version")
        entries = []
        for rank, record in enumerate(records, start=1):
            row = self._row(record)
            row["rank"] = rank
            row["is_promoted"] = bool(version) and record["promotion"].get("version") == version
            entries.append(row)
        return Leaderboard(model, metric, mode, metrics, entries, pointer)

    def _promoted_record(self, pointer: dict[str, Any] | None) -> dict[str, Any] | None:
        if not pointer or not isinstance(pointer.get("run_uri"), str):
            return None
        from kubetrain.s3_layout import RunLocation

        try:
            record = self.store.runs.get(RunLocation.from_uri(pointer["run_uri"]))
        except ValueError:
            return None
        if not record or safe_segment(record["dag_id"]) not in self.readable:
            return None
        return record

    def promotions(self, model: str, *, limit: int = PAGE_SIZE) -> list[dict[str, Any]]:
        """The model's promotion history, newest first; promotions of unreadable DAGs' runs are left out."""
        self._check_model(model)
        return [
            p
            for p in self.store.promotions.newest(model, limit=limit)
            if safe_segment(str(p.get("dag_id"))) in self.readable
        ]

    # -- runs side by side ---------------------------------------------------------------------

    def record(self, ref: str) -> dict[str, Any]:
        """The record of one run, or :class:`NotVisible`."""
        dag, run, trial = parse_ref(ref)
        if dag not in self.readable:
            raise NotVisible(ref)
        key = f"runs/{ref}/{RUN_RECORD_JSON}"
        record = self.store.read_json(self.bucket, key)
        if not isinstance(record, dict) or safe_segment(str(record.get("dag_id"))) not in self.readable:
            raise NotVisible(ref)
        return self._row(record)

    def compare(self, refs: list[str]) -> Comparison:
        """Two to five runs: their records, their history.csv and their params side by side."""
        from kubetrain.report.inputs import parse_history

        unique = list(dict.fromkeys(r for r in refs if r))
        if not COMPARE_MIN <= len(unique) <= COMPARE_MAX:
            raise QueryError(f"select {COMPARE_MIN} to {COMPARE_MAX} runs to compare: got {len(unique)}")
        for ref in unique:
            parse_ref(ref)
        if any(parse_ref(ref)[0] not in self.readable for ref in unique):
            raise NotVisible(", ".join(unique))
        records = self.store.read_many(self.bucket, [f"runs/{ref}/{RUN_RECORD_JSON}" for ref in unique])
        missing = [ref for ref, rec in zip(unique, records, strict=True) if not isinstance(rec, dict)]
        if missing:
            raise NotVisible(", ".join(missing))
        runs = [self._row(r) for r in records if isinstance(r, dict)]  # all are, as checked
        histories: list[History | None] = []
        raws = self._read_raw([f"runs/{ref}/output/history.csv" for ref in unique])
        for raw in raws:
            try:
                histories.append(parse_history(raw) if raw is not None else None)
            except ValueError:
                histories.append(None)
        return Comparison(runs, histories, param_table(runs))

    def _read_raw(self, keys: list[str]) -> list[bytes | None]:
        from concurrent.futures import ThreadPoolExecutor

        def one(key: str) -> bytes | None:
            return self.store.read(self.bucket, key)

        with ThreadPoolExecutor(max_workers=len(keys) or 1) as pool:
            return list(pool.map(one, keys))

    # -- sweeps --------------------------------------------------------------------------------

    def sweep(self, *, model: str, dag_id: str, run_id: str, run_time: str) -> list[dict[str, Any]]:
        """The trials of a sweep (the records of one DAG run that have a trial), best first on their objective."""
        try:
            check_name("model", model)
        except ValueError as exc:
            raise QueryError(str(exc)) from None
        if safe_segment(dag_id) not in self.readable:
            raise NotVisible(f"{dag_id}/{run_id}")
        if not re.fullmatch(r"\d{13}", run_time or ""):
            raise QueryError(f"t={run_time!r} is not valid: expected the 13-digit time of the run index")
        prefix = self.store.layout.run_index_prefix(model) + "~".join(
            (run_time, model, safe_segment(dag_id), safe_segment(run_id), "")
        )
        entries = [e for e in self._entries(prefix, None) if e.trial]
        records = [
            r for r in self.store.read_many(self.bucket, [e.key for e in entries]) if isinstance(r, dict)
        ]
        return rank_trials([self._row(r) for r in records])


def rank_trials(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trials best first on their objective (the sweep's when it names one, else the run's monitor); failed last."""

    def objective(record: dict[str, Any]) -> tuple[int, float]:
        sweep = record.get("sweep") or {}
        goal = sweep.get("objective")
        if not isinstance(goal, dict):
            goal = {}
        metrics = record.get("metrics") or {}
        value = goal.get("value", metrics.get("value"))
        mode = goal.get("mode") or metrics.get("monitor_mode") or "max"
        if record.get("status") != "success" or not isinstance(value, int | float):
            return (1, 0.0)
        return (0, -value if mode == "max" else value)

    ranked = sorted(records, key=objective)
    for rank, record in enumerate(ranked, start=1):
        record["rank"] = rank
    return ranked


def _dags_of(db: RunsDb, readable: Iterable[str]) -> set[str]:
    """The DAG segments among ``readable`` with a row in the run index database (one probe of its dag index each)."""
    return {
        dag
        for dag in readable
        if db.conn.execute("SELECT 1 FROM runs WHERE dag = ? LIMIT 1", (dag,)).fetchone() is not None
    }


def fold_sweeps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs list's rows: a run as it is, and the trials of one sweep (one DAG run) folded into one row.

    A folded row is ``{"folded_sweep": True, "best": <best trial>, "trials": [...], "counts": {...},
    "promoted": <the promoted trial or None>}`` at the place of the sweep's newest trial; its link
    opens the sweep's page, which lists every trial. The
    trials of one DAG run sit side by side in the index (they share its time), so a page shows each
    sweep once; one that a page boundary cuts is folded on both pages, each with the trials it holds.
    """
    rows: list[dict[str, Any]] = []
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        if run.get("trial") in (None, ""):
            rows.append(run)
            continue
        key = (str(run.get("dag_id")), str(run.get("run_id")))
        group = groups.get(key)
        if group is None:
            group = groups[key] = {"folded_sweep": True, "trials": []}
            rows.append(group)
        group["trials"].append(run)
    for group in groups.values():
        ranked = rank_trials([dict(t) for t in group["trials"]])
        group["best"] = ranked[0]
        statuses = [t.get("status") for t in ranked]
        group["counts"] = {
            "success": statuses.count("success"),
            "failed": statuses.count("failed"),
            "stopped_early": sum(
                1
                for t in ranked
                if t.get("status") == "success" and (t.get("sweep") or {}).get("stopped_early")
            ),
        }
        group["promoted"] = next((t for t in ranked if (t.get("promotion") or {}).get("promoted")), None)
    return rows


def sweep_time(record: dict[str, Any]) -> str:
    """The ``t`` of a sweep link: the run index's time field of the record's DAG run."""
    return inverted_time(run_time_of(record))


def _leaderboard_dag(key: str) -> str | None:
    try:
        return LeaderboardEntry.parse(key, "max").dag
    except ValueError:
        return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def param_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows ``{"name", "source", "values", "differs"}``: those that differ first; within each, the trainer's
    hyperparameters, then the run's other Params."""
    rows = []
    seen: set[str] = set()
    for source in ("hyperparameters", "params"):
        names = sorted({name for run in runs for name in (run.get(source) or {})})
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            values = [
                (run.get("hyperparameters") or {}).get(name, (run.get("params") or {}).get(name))
                if source == "hyperparameters"
                else (run.get("params") or {}).get(name)
                for run in runs
            ]
            rows.append(
                {
                    "name": name,
                    "source": source,
                    "values": values,
                    "differs": len({_canonical(v) for v in values}) > 1,
                }
            )
    # what differs first: with a trainer's dozens of hyperparameters, the differences are the point
    return sorted(rows, key=lambda row: not row["differs"])
