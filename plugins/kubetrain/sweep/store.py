"""A sweep's documents in S3, read through the run store: the plan, the rounds, the trial records.

The suggest tasks, the trials and the leaderboard all read them, so they live here, below the
operators' modules (:mod:`~kubetrain.sweep.plan`, :mod:`~kubetrain.sweep.trial`,
:mod:`~kubetrain.sweep.leaderboard`), at the keys of :mod:`kubetrain.sweep.records`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

from kubetrain.operators.base import RunStoreOperator
from kubetrain.run_store import RunStore
from kubetrain.s3_layout import RunLocation, s3_uri
from kubetrain.sweep.records import EARLY_STOP_RECORD, SweepLocation, assemble_trial
from kubetrain_contract.early_stop import EarlyStopRecord
from kubetrain_contract.trial import SweepRoundRecord, TrialRecord

if TYPE_CHECKING:
    from airflow.sdk import Context

#: what a trial that left no record failed with, as the leaderboard shows it
NO_RECORD = "the trial's task failed without a record (see its log)"


def plan_missing(sweep: SweepLocation) -> AirflowFailException:
    return AirflowFailException(
        f"the sweep has no plan at {s3_uri(sweep.bucket, sweep.plan_key)}: the plan task did not finish (see its log)"
    )


class SweepStoreOperator(RunStoreOperator):
    """An operator that works on this DAG run's sweep prefix."""

    def sweep_location(self, context: Context) -> SweepLocation:
        return SweepLocation.of(self.store.layout, context["ti"].dag_id, context["run_id"])

    def load_plan(self, sweep: SweepLocation) -> dict[str, Any]:
        plan = self.store.read_json(sweep.bucket, sweep.plan_key)
        if not isinstance(plan, dict):
            raise plan_missing(sweep)
        return plan


def read_trial(store: RunStore, bucket: str, key: str) -> TrialRecord | None:
    """The trial record at ``key``, or ``None`` when there is none.

    :raises RecordError: naming the document and the field, for one that is not a trial record.
    """
    body = store.read(bucket, key)
    return None if body is None else TrialRecord.from_json(body, where=s3_uri(bucket, key))


def write_trial(store: RunStore, bucket: str, key: str, record: TrialRecord) -> str:
    """Write ``record`` at ``key`` (its JSON, as :meth:`RunStore.write_json` lays a document out); its URI."""
    return store.write(bucket, key, record.to_json(indent=2) + "\n")


def early_stop_key(run: RunLocation) -> str:
    """Key of the sidecar's early-stop decision for ``run`` (``sync/early-stop.json``)."""
    return f"{run.prefix}/sync/{EARLY_STOP_RECORD}"


def parse_early_stop(run: RunLocation, body: bytes | None) -> EarlyStopRecord | None:
    """The early-stop decision read from :func:`early_stop_key`, or ``None`` when there was none."""
    return (
        None
        if body is None
        else EarlyStopRecord.from_json(body, where=s3_uri(run.bucket, early_stop_key(run)))
    )


def read_early_stop(store: RunStore, run: RunLocation) -> EarlyStopRecord | None:
    """The sidecar's early-stop decision for ``run`` (``sync/early-stop.json``), or ``None``."""
    return parse_early_stop(run, store.read(run.bucket, early_stop_key(run)))


def load_trial_records(store: RunStore, sweep: SweepLocation) -> dict[int, TrialRecord]:
    """The sweep's trial records by trial number."""
    records: dict[int, TrialRecord] = {}
    for item in store.list(sweep.bucket, sweep.trials_prefix):
        number = SweepLocation.trial_number(item["Key"])
        if number is None:
            continue
        record = read_trial(store, sweep.bucket, item["Key"])
        if record is not None:
            records[number] = record
    return records


def load_rounds(store: RunStore, sweep: SweepLocation) -> dict[int, SweepRoundRecord]:
    """The points each round asked for, by round number.

    :raises RecordError: naming the document and the field, for one that is not a round record.
    """
    rounds: dict[int, SweepRoundRecord] = {}
    for item in store.list(sweep.bucket, sweep.rounds_prefix):
        number = SweepLocation.round_number(item["Key"])
        if number is not None and (body := store.read(sweep.bucket, item["Key"])) is not None:
            rounds[number] = SweepRoundRecord.from_json(body, where=s3_uri(sweep.bucket, item["Key"]))
    return rounds


def all_trials(store: RunStore, sweep: SweepLocation) -> list[TrialRecord]:
    """Every trial the sweep planned, by number: its record, or a ``failed`` stand-in when it left none."""
    records = load_trial_records(store, sweep)
    trials: dict[int, TrialRecord] = {}
    for round_number, doc in sorted(load_rounds(store, sweep).items()):
        for planned in doc.trials:
            number = planned.number
            trials[number] = records.get(number) or assemble_trial(
                None,
                number,
                round=round_number,
                params=planned.params,
                fingerprint=planned.fingerprint,
                run_uri=sweep.trial_run(number).uri,
                finished_at=None,
                error=NO_RECORD,
            )
    for number, record in records.items():
        trials.setdefault(number, record)
    return [trials[n] for n in sorted(trials)]
