"""Where kubetrain keeps things in S3: the one module that knows the layout.

::

    s3://<datasets bucket>/<dataset>/...                      user data
    s3://<training bucket>/manifests/<dataset>/<version>.json  staged snapshot
    s3://<training bucket>/prepared/<dataset>/<version>/<key>/  prepared copies of a snapshot
    s3://<training bucket>/runs/<dag_id>/<run>/checkpoints/    per run
    s3://<training bucket>/runs/<dag_id>/<run>/output/         metrics, model
    s3://<training bucket>/runs/<dag_id>/<run>/sync/           sync pass manifests
    s3://<training bucket>/runs/<dag_id>/<run>/report/         report + plots
    s3://<training bucket>/models/<model>/<version>/           promoted models
    s3://<training bucket>/models/<model>/latest               pointer to the promoted version
    s3://<training bucket>/trained/<dag_id>/<fingerprint>.json  "trained once" markers
    s3://<training bucket>/runs/<dag_id>/<run>/run-record.json  the run's record (kubetrain.run_record)
    s3://<training bucket>/index/<model or _all>/<entry>.json   copies of run records, newest first
    s3://<training bucket>/leaderboard/<model>/<metric>/<entry>.json  copies, best first
    s3://<training bucket>/promotions/<model>/<entry>.json      promotion history, newest first

``<run>`` is the Airflow run id made S3-safe by :func:`safe_segment`; it does not contain the
try number, so a retried training task finds its own checkpoints. Mapped tasks (a sweep) get
``<run>/trials/<trial>`` so that parallel pods never share a prefix.

Buckets are the settings ``datasets_bucket`` and ``training_bucket`` (:mod:`kubetrain.settings`:
the Airflow Variables ``kubetrain_datasets_bucket`` and ``kubetrain_training_bucket``, else
``KUBETRAIN_DATASETS_BUCKET`` and ``KUBETRAIN_TRAINING_BUCKET``, else ``datasets`` and
``training``). They are looked up when a task runs, never when a DAG file is parsed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubetrain import settings
from kubetrain_contract.run_layout import RUN_RECORD_JSON, SYNC_AREA, pass_key, pass_number
from kubetrain_contract.s3uri import check_bucket, parse_s3_uri

DEFAULT_DATASETS_BUCKET = settings.SETTINGS["datasets_bucket"].default
DEFAULT_TRAINING_BUCKET = settings.SETTINGS["training_bucket"].default
# the Secret whose AWS_* keys give pods their S3 access (include/devstack creates it)
DEFAULT_S3_SECRET = settings.SETTINGS["s3_secret"].default
AREAS = ("checkpoints", "output", SYNC_AREA, "report")
# the run index of every model; model names start with a letter or digit, so this is none of them
ALL_MODELS = "_all"

_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,98}[a-z0-9])?$")
_VERSION = re.compile(r"^[0-9a-f]{16}$")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` when it is a valid dataset or model name, else raise ``ValueError``.

    :param kind: what the name names ("dataset", "model"), for the error message.
    :param value: the name: lower-case letters, digits, '.', '_' and '-', starting and ending
        with a letter or digit, at most 100 characters.
    """
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise ValueError(
            f"{kind} name {value!r} is not valid: expected 1-100 characters of a-z, 0-9, '.', '_' and '-', "
            "starting and ending with a letter or digit"
        )
    return value


def check_version(version: str) -> str:
    """Return ``version`` when it is a dataset version (16 lower-case hex digits), else raise."""
    if not isinstance(version, str) or not _VERSION.match(version):
        raise ValueError(f"dataset version {version!r} is not valid: expected 16 lower-case hex digits")
    return version


def safe_segment(value: str) -> str:
    """Turn an Airflow id (run id, trial) into one S3-safe path segment.

    Characters outside ``A-Z a-z 0-9 . _ -`` (the ``:`` and ``+`` of run ids such as
    ``manual__2026-11-22T04:00:00+00:00``) become ``_``; when anything was replaced, eight hex
    digits of the original's SHA-256 are appended, so two ids never share a segment.

    :param value: the id.
    """
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"cannot make an S3 path segment from {value!r}: expected a non-empty string")
    cleaned = _SAFE_CHARS.sub("_", value)
    if cleaned != value or cleaned in (".", ".."):
        cleaned = f"{cleaned}-{hashlib.sha256(value.encode()).hexdigest()[:8]}"
    return cleaned


# kubetrain's own areas of the training bucket: never a dataset (they hold other DAGs' runs and models)
TRAINING_AREAS = (
    "manifests/",
    "prepared/",
    "runs/",
    "models/",
    "trained/",
    "index/",
    "leaderboard/",
    "promotions/",
    "preflight/",
)


def _prefix(uri: str, what: str) -> tuple[str, str]:
    bucket, key = parse_s3_uri(str(uri).strip())
    if any(part in (".", "..") for part in key.split("/")) or "//" in key:
        raise ValueError(
            f"{what} {uri!r} is not a plain prefix: expected s3://<bucket>/<prefix>/ without '.', '..' "
            "or empty segments"
        )
    return bucket, key if not key or key.endswith("/") else key + "/"


def _within(bucket: str, key: str, prefix: tuple[str, str]) -> bool:
    return bucket == prefix[0] and (key if key.endswith("/") else key + "/").startswith(prefix[1])


def check_dataset_source(
    uri: str, *, allowed: Sequence[str], training_bucket: str, narrowed: Sequence[str] = ()
) -> str:
    """Return ``uri`` when a run may stage a dataset from it, else raise ``ValueError`` naming why.

    :param uri: the dataset URI a run asks for (a Param: whoever may trigger the DAG chose it).
    :param allowed: the deployment's prefixes (the ``dataset_prefixes`` setting; empty: the whole datasets bucket,
        given by the caller as ``s3://<datasets bucket>/``).
    :param training_bucket: the training bucket, whose kubetrain areas are never a dataset.
    :param narrowed: the DAG's own prefixes, each within ``allowed``; the source must be within one of them too.
    """
    bucket, key = parse_s3_uri(str(uri).strip())
    if any(part in (".", "..") for part in key.split("/")):
        raise ValueError(
            f"dataset {uri!r} has a '.' or '..' segment: expected a plain s3://<bucket>/<prefix>"
        )
    deployment = [_prefix(a, "dataset prefix") for a in allowed]
    dag = [_prefix(n, "the DAG's dataset prefix") for n in narrowed]
    for prefix, raw in zip(dag, narrowed, strict=True):
        if not any(_within(prefix[0], prefix[1], d) for d in deployment):
            raise ValueError(
                f"the DAG's dataset prefix {raw!r} is outside the deployment's ({', '.join(allowed)}): "
                "a DAG may only narrow them"
            )
    if bucket == training_bucket and (
        not key or any((key + "/").startswith(a) or key.startswith(a) for a in TRAINING_AREAS)
    ):
        raise ValueError(
            f"dataset {uri!r} is inside kubetrain's own area of the training bucket (runs, models, "
            "manifests, ...): datasets come from the datasets bucket"
        )
    for prefixes, names, whose in ((deployment, allowed, "the deployment's"), (dag, narrowed, "this DAG's")):
        if prefixes and not any(_within(bucket, key, p) for p in prefixes):
            raise ValueError(
                f"dataset {uri!r} is outside {whose} dataset prefixes ({', '.join(names)}): a run may "
                "stage only from them (setting dataset_prefixes, default the datasets bucket)"
            )
    return uri


def s3_uri(bucket: str, key: str = "") -> str:
    """Return ``s3://bucket/key``."""
    return f"s3://{bucket}/{key}"


def utc_stamp(when: datetime | None = None) -> str:
    """Return ``when`` (default now) as an ISO 8601 UTC string ending in ``Z``."""
    when = (when or datetime.now(UTC)).astimezone(UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class RunLocation:
    """The S3 prefix of one training run (``runs/<dag_id>/<run>``, no trailing slash)."""

    bucket: str
    prefix: str

    def __post_init__(self) -> None:
        check_bucket(self.bucket)
        if not self.prefix or self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ValueError(
                f"run prefix {self.prefix!r} is not valid: expected a key prefix without leading or trailing '/'"
            )

    @classmethod
    def from_uri(cls, uri: str) -> RunLocation:
        """Parse a run URI such as ``s3://training/runs/train_digits/manual__2026...``."""
        bucket, key = parse_s3_uri(uri)
        return cls(bucket, key.rstrip("/"))

    @property
    def uri(self) -> str:
        """The run URI, as the pod sees it in ``KUBETRAIN_RUN_URI``."""
        return s3_uri(self.bucket, self.prefix)

    def area_prefix(self, area: str) -> str:
        """Key prefix of an area of the run (``checkpoints``, ``output``, ``sync``, ``report``), with '/'."""
        if area not in AREAS:
            raise ValueError(f"unknown run area {area!r}: expected one of {', '.join(AREAS)}")
        return f"{self.prefix}/{area}/"

    def key(self, area: str, path: str) -> str:
        """Key of a file of the run, ``path`` being relative to the area."""
        path = path.lstrip("/")
        if not path or any(part in ("", ".", "..") for part in path.split("/")):
            raise ValueError(f"path {path!r} is not a plain relative path inside the {area} area")
        return self.area_prefix(area) + path

    def pass_key(self, number: int) -> str:
        """Key of the sync pass manifest number ``number``."""
        return pass_key(self.prefix, number)

    @staticmethod
    def pass_number(key: str) -> int | None:
        """The pass number of a sync manifest key, or ``None`` when ``key`` is not one."""
        return pass_number(key)


@dataclass(frozen=True)
class S3Layout:
    """Bucket names and the key scheme built on them."""

    datasets_bucket: str = DEFAULT_DATASETS_BUCKET
    training_bucket: str = DEFAULT_TRAINING_BUCKET

    def __post_init__(self) -> None:
        check_bucket(self.datasets_bucket)
        check_bucket(self.training_bucket)

    @classmethod
    def from_environment(
        cls, *, training_bucket: str | None = None, datasets_bucket: str | None = None
    ) -> S3Layout:
        """The layout of this deployment; explicit arguments beat Variables and environment."""
        return cls(
            datasets_bucket=datasets_bucket or settings.get("datasets_bucket"),
            training_bucket=training_bucket or settings.get("training_bucket"),
        )

    # -- datasets ------------------------------------------------------------------------------

    def dataset_uri(self, dataset: str) -> str:
        """Default source of a dataset: ``s3://<datasets bucket>/<dataset>/``."""
        return s3_uri(self.datasets_bucket, f"{check_name('dataset', dataset)}/")

    def manifest_key(self, dataset: str, version: str) -> str:
        """Key of a staged dataset snapshot manifest."""
        return f"manifests/{check_name('dataset', dataset)}/{check_version(version)}.json"

    def manifest_uri(self, dataset: str, version: str) -> str:
        return s3_uri(self.training_bucket, self.manifest_key(dataset, version))

    def prepared_prefix(self, dataset: str, version: str) -> str:
        """Key prefix (with '/') of the prepared copies of a staged snapshot, one folder per preprocessing key.

        A trainer derives them from the snapshot (decoded, checked, resized records); the
        checkpoint-sync sidecar uploads a fresh one here and every later stage-in of the same
        version downloads it (``KUBETRAIN_PREPARED_URI``).
        """
        return f"prepared/{check_name('dataset', dataset)}/{check_version(version)}/"

    def prepared_uri(self, dataset: str, version: str) -> str:
        """``s3://<training bucket>/prepared/<dataset>/<version>/``, as the pod gets it in ``KUBETRAIN_PREPARED_URI``."""
        return s3_uri(self.training_bucket, self.prepared_prefix(dataset, version))

    # -- runs ----------------------------------------------------------------------------------

    def run(self, dag_id: str, run_id: str, trial: str | None = None) -> RunLocation:
        """The run prefix of a DAG run (stable across task retries), or of one trial of a sweep."""
        prefix = f"runs/{safe_segment(dag_id)}/{safe_segment(run_id)}"
        if trial not in (None, ""):
            prefix += f"/trials/{safe_segment(str(trial))}"
        return RunLocation(self.training_bucket, prefix)

    def trained_marker_key(self, dag_id: str, fingerprint: str) -> str:
        """Key of the marker that says a DAG finished training on a dataset version with given Params."""
        if not re.fullmatch(r"[0-9a-f]{8,64}", fingerprint or ""):
            raise ValueError(f"fingerprint {fingerprint!r} is not valid: expected 8-64 lower-case hex digits")
        return f"trained/{safe_segment(dag_id)}/{fingerprint}.json"

    def run_record_key(self, run: RunLocation) -> str:
        """Key of a run's record (written by the pipeline's record step)."""
        return f"{run.prefix}/{RUN_RECORD_JSON}"

    def run_index_prefix(self, model: str | None = None) -> str:
        """Key prefix (with '/') of the run index of ``model``, or of every model (``None``)."""
        return f"index/{check_name('model', model) if model is not None else ALL_MODELS}/"

    def leaderboard_prefix(self, model: str, metric: str | None = None) -> str:
        """Key prefix (with '/') of a model's leaderboard entries (of one metric, when given)."""
        prefix = f"leaderboard/{check_name('model', model)}/"
        return prefix + (f"{safe_segment(metric)}/" if metric is not None else "")

    def promotions_prefix(self, model: str) -> str:
        """Key prefix (with '/') of the promotion history of ``model``."""
        return f"promotions/{check_name('model', model)}/"

    # -- models --------------------------------------------------------------------------------

    def model_prefix(self, model: str, version: str) -> str:
        """Key prefix (with '/') of a promoted model version."""
        return f"models/{check_name('model', model)}/{safe_segment(version)}/"

    def model_latest_key(self, model: str) -> str:
        """Key of the small JSON pointer to the promoted version of ``model``."""
        return f"models/{check_name('model', model)}/latest"


def prepared_uri_of(manifest_uri: str) -> str:
    """The prepared copies' prefix beside a staged snapshot: ``s3://<bucket>/manifests/<dataset>/<version>.json``
    gives ``s3://<bucket>/prepared/<dataset>/<version>/`` (:meth:`S3Layout.prepared_uri`).

    :param manifest_uri: the staged manifest's URI, as the stage task returns it (``manifest_uri``).
    :raises ValueError: ``manifest_uri`` is not a staged manifest's URI, naming what was expected.
    """
    bucket, key = parse_s3_uri(str(manifest_uri).strip())
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "manifests" or not parts[2].endswith(".json"):
        raise ValueError(
            f"dataset manifest {manifest_uri!r} is not a staged snapshot's: expected "
            "s3://<training bucket>/manifests/<dataset>/<version>.json"
        )
    return S3Layout(training_bucket=bucket).prepared_uri(parts[1], parts[2].removesuffix(".json"))


def model_version(run: RunLocation, when: datetime) -> str:
    """A sortable model version for a run: ``<UTC time>-<8 hex digits of the run URI>``.

    :param run: the run whose output is promoted; the same run always gets the same suffix.
    :param when: the run's time (e.g. the DAG run's ``run_after``), stable across retries.
    """
    stamp = when.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{hashlib.sha256(run.uri.encode()).hexdigest()[:8]}"


def run_from_context(
    context: Mapping[str, Any],
    *,
    run_uri: str | None = None,
    trial: str | None = None,
    training_bucket: str | None = None,
) -> RunLocation:
    """The run location of the task instance in ``context`` (or ``run_uri`` when given).

    Mapped task instances without an explicit ``trial`` use their map index as trial, so the
    pods of a sweep never write to the same prefix.
    """
    if run_uri:
        return RunLocation.from_uri(run_uri)
    ti = context["ti"]
    map_index = getattr(ti, "map_index", -1)
    if trial in (None, "") and map_index is not None and map_index >= 0:
        trial = str(map_index)
    layout = S3Layout.from_environment(training_bucket=training_bucket)
    return layout.run(ti.dag_id, context["run_id"], trial)
