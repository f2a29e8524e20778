"""The run record and the promotion event: what the training pipeline keeps of each run and promotion.

The Airflow side's record step writes a :class:`RunRecord` at ``<run>/run-record.json`` for every
finished training run and copies it into the run indexes (``index/<model>/``, ``index/_all/``,
``leaderboard/<model>/<metric>/``); the promote step appends a :class:`PromotionEvent` to
``promotions/<model>/``. Both are read by the Training page and by MLflow tracking.

Besides the field types :mod:`kubetrain_contract.records` checks, each record checks the string
limits its schema states (``pattern``, ``minLength``, ``maxLength``, ``format: date-time``), so
that a value the schema refuses is never written.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Literal

from kubetrain_contract.records import Record, spec

MODEL_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,98}[a-z0-9])?$"
RUN_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/runs/.+[^/]$"
METRICS_SECTION = "Metric name to value (null where the trainer wrote NaN or nothing)."


def check_strings(obj: Any, where: str) -> None:
    """Raise ``ValueError`` for a string field of ``obj`` outside its spec's pattern, length or format.

    :param obj: a record or one of its nested dataclasses.
    :param where: the path of ``obj`` in its document (``""`` for the record, ``"dataset."``...).
    """
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if not isinstance(value, str):
            continue
        limits = field.metadata.get("schema", {})
        name = where + field.metadata.get("json_name", field.name)
        expected = None
        if "pattern" in limits and not re.search(limits["pattern"], value):
            expected = f"a string matching {limits['pattern']}"
        elif len(value) < limits.get("minLength", 0):
            expected = f"at least {limits['minLength']} character(s)"
        elif "maxLength" in limits and len(value) > limits["maxLength"]:
            expected = f"at most {limits['maxLength']} characters"
        elif limits.get("format") == "date-time" and not _is_date_time(value):
            expected = "an ISO 8601 date-time such as 2026-03-02T08:00:00Z"
        if expected:
            shown = value if len(value) <= 200 else value[:200] + "..."
            raise ValueError(f"field {name!r} is {shown!r}, expected {expected}")


def _is_date_time(value: str) -> bool:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).tzinfo is not None
    except ValueError:
        return False


@dataclass(frozen=True)
class Checked:
    """A nested object whose string fields are checked against their spec."""

    PATH: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_strings(self, self.PATH)


@dataclass(frozen=True)
class RunFailure(Checked):
    """The task that failed the run, and its error."""

    PATH = "failure."

    task: str
    error: str = spec(maxLength=2000)


@dataclass(frozen=True)
class RunInterruption(Checked):
    """One training pod that the cluster ended before its training finished (preempted, evicted,
    drained or deleted); a new pod resumed in the same try, without using a retry."""

    PATH = "disruptions.interruptions[]."

    pod: str | None
    reason: str = spec(maxLength=2000)
    at: str = spec(format="date-time", description="When the task saw the pod ended.")
    queued_s: float | None = spec(
        description="Seconds the pod waited for Kueue's admission; null: never queued."
    )
    exit_code: int | None = spec(
        description="The training container's exit code when it was seen (75: it checkpointed on SIGTERM)."
    )
    resume_step: int | None = spec(
        minimum=0,
        description="The newest checkpointed step in S3 after the pod ended (its last sync pass): where the "
        "next pod resumed. Null: no numbered checkpoint had been synced.",
    )
    steps_lost: int | None = spec(
        minimum=0,
        description="Steps trained and not kept: 0 when the container checkpointed on SIGTERM (exit 75) and its "
        "final sync pass kept that checkpoint; null when not known (a container that did not say so).",
    )


@dataclass(frozen=True)
class RunDisruptions(Checked):
    """What the cluster did to the run's last try: its preemptions and evictions, and its time in the queue."""

    PATH = "disruptions."

    preemptions: int = spec(minimum=0, description="Pods ended from outside (interruptions) in the try.")
    queued_s: float = spec(
        minimum=0, description="Seconds the try's pods waited for Kueue's admission, in all."
    )
    steps_lost: int | None = spec(
        minimum=0, description="The sum of the interruptions' steps_lost; null when any is not known."
    )
    interruptions: list[RunInterruption]  # type: ignore[misc]  # after a spec() field: see spec()


@dataclass(frozen=True)
class DatasetRef(Checked):
    """The staged dataset snapshot the run trained on."""

    PATH = "dataset."

    uri: str | None
    version: str | None = spec(pattern=r"^[0-9a-f]{16}$")
    manifest_uri: str | None  # type: ignore[misc]  # after a spec() field: see spec()


@dataclass(frozen=True)
class ImageRef(Checked):
    """The training image, by digest where it is known."""

    PATH = "image."

    reference: str | None
    digest: str | None = spec(pattern=r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class RunMetrics:
    """The objective and the final and best metrics of metrics.json."""

    monitor: str | None = spec(description="The objective metric (metrics.json's monitor).")
    monitor_mode: Literal["max", "min", None]  # type: ignore[misc]  # after a spec() field: see spec()
    compare_on: Literal["final", "best"]  # type: ignore[misc]  # after a spec() field: see spec()
    value: float | None = spec(
        description="The objective's value in the compare_on section: what the leaderboard ranks."
    )
    final: dict[str, int | float | None] = spec(description=METRICS_SECTION)
    best: dict[str, int | float | None] = spec(description=METRICS_SECTION)


@dataclass(frozen=True)
class VersionValue:
    """A promoted version of the model and its objective value."""

    version: str
    value: float | None


@dataclass(frozen=True)
class MetricValue:
    """The compared metric and this run's value of it."""

    name: str | None
    value: float | None


@dataclass(frozen=True)
class RunPromotion(Checked):
    """Whether the run's model was promoted, and why."""

    PATH = "promotion."

    rule: Literal["if_better", "always", "never", None]
    promoted: bool
    version: str | None
    model_uri: str | None
    reason: str = spec(minLength=1)
    compared_with: VersionValue | None  # type: ignore[misc]  # after a spec() field: see spec()


@dataclass(frozen=True)
class MlflowRun:
    """Where MLflow tracking logged the run."""

    experiment_id: str = spec(description="The MLflow experiment the run was logged to.")
    run_id: str = spec(description="The MLflow run's id.")
    url: str | None = spec(None, description="The run's page in the MLflow UI, when MLflow has one.")
    model_version: str | None = spec(None, description="The registered model version a promotion made.")


@dataclass(frozen=True, kw_only=True)
class RunRecord(Record):
    """Written by the training pipeline's record step (Airflow side, kubetrain.run_record) at
    <run>/run-record.json for every finished training run, and copied into index/<model>/,
    index/_all/ and leaderboard/<model>/<metric>/. A sweep fills `trial` and `sweep`; a distributed
    run fills `distributed`."""

    KIND = "kubetrain/run-record"
    SCHEMA_NAME = "run-record"
    TITLE = "kubetrain run record, format version 1"

    dag_id: str = spec(minLength=1, maxLength=250)
    run_id: str = spec(minLength=1, maxLength=250)
    trial: str | None = spec(
        description="Sweep trial (the mapped task's index unless named); null for a single run."
    )
    run_uri: str = spec(pattern=RUN_URI_PATTERN)
    run_time: str = spec(
        format="date-time",
        description="The DAG run's time (run_after): the same for every retry, the index's order.",
    )
    recorded_at: str = spec(format="date-time")
    status: Literal["success", "failed"]
    failure: RunFailure | None
    model: str = spec(pattern=MODEL_PATTERN)
    trainer: str | None
    dataset: DatasetRef
    image: ImageRef
    code_version: str | None
    fingerprint: str | None = spec(pattern=r"^[0-9a-f]{8,64}$")
    params: dict[str, Any] = spec(description="The DAG run's Params.")
    hyperparameters: dict[str, Any] = spec(description="What the trainer recorded in output/params.json.")
    metrics: RunMetrics
    epochs: int | None = spec(minimum=0)
    steps: int | None = spec(minimum=0)
    wall_time_s: float | None
    examples_per_s: float | None
    resumed_from_step: int | None = spec(
        minimum=0, description="Step the last pod resumed from; 0 when it started fresh; null when unknown."
    )
    resumed_from_source: Literal["metrics.json", "sync-passes", None]
    promotion: RunPromotion
    report_uri: str | None
    report_url: str | None
    sweep: dict[str, Any] | None = spec(
        description="A sweep trial: the sweep is the DAG run; its leaderboard is built from the records of "
        "its trials. id (<dag_id>/<run_id> of the sweep), trial, algorithm, params (the hyperparameters "
        "this trial drew from the space), stopped_early, objective (name, mode, value)."
    )
    distributed: dict[str, Any] | None = spec(description="A distributed run: backend, workers, ps_replicas.")
    mlflow: MlflowRun | None
    disruptions: RunDisruptions | None = spec(
        None,
        description="Preemptions, evictions and time queued of the run's last try. Optional: absent in records "
        "written before it existed, and for runs the cluster never queued or interrupted.",
    )

    def __post_init__(self) -> None:
        check_strings(self, "")
        if self.sweep is not None and not (
            isinstance(self.sweep.get("id"), str) and isinstance(self.sweep.get("trial"), str)
        ):
            raise ValueError(
                f"field 'sweep' is {self.sweep!r}, expected an object with the strings id and trial"
            )


@dataclass(frozen=True, kw_only=True)
class PromotionEvent(Record):
    """Written by the promote step (PromoteModelOperator) at promotions/<model>/<inverted time>~<version>.json
    each time a run's model becomes the promoted version of <model>; listing the prefix gives the
    history newest first."""

    KIND = "kubetrain/promotion"
    SCHEMA_NAME = "promotion"
    TITLE = "kubetrain promotion, format version 1"

    model: str = spec(pattern=MODEL_PATTERN)
    version: str = spec(minLength=1)
    model_uri: str = spec(pattern="^s3://")
    promoted_at: str = spec(format="date-time")
    dag_id: str = spec(minLength=1)
    run_id: str = spec(minLength=1)
    trial: str | None
    run_uri: str = spec(pattern="^s3://")
    rule: Literal["if_better", "always"]
    reason: str = spec(minLength=1)
    metric: MetricValue
    previous: VersionValue | None

    def __post_init__(self) -> None:
        check_strings(self, "")
