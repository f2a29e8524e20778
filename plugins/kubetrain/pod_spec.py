"""The training pod, built once from ``kubernetes.client`` models.

Every training pod follows the same contract::

    initContainers:
      stage-in         sync image: the staged dataset snapshot -> /data, this run's latest
                       checkpoints -> /checkpoints (resume after a retry)
      checkpoint-sync  native sidecar (restartPolicy Always): /checkpoints and /output -> S3
                       every KUBETRAIN_SYNC_INTERVAL seconds, a final pass on SIGTERM
    containers:
      base             the training image; reads DATA_DIR, writes CHECKPOINT_DIR and OUTPUT_DIR
    volumes:           emptyDir for /data, /checkpoints, /output

S3 credentials reach the sync containers only through ``envFrom`` of a Secret (or workload
identity through a service account); the base container gets none, so a third-party
training script never sees them. Every container runs as a non-root numeric user without
privilege escalation or capabilities, and has requests and limits.

Local storage is sized from the dataset (:func:`scratch_sizes`): the emptyDirs get ``sizeLimit``s
and the containers that write to them an ``ephemeral-storage`` request (and, when the dataset's
size is known, an equal limit) that add up to what the node must hold, so that the scheduler
places the pod where its dataset fits and the kubelet does not evict it under disk pressure.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal

from kubernetes.client import models as k8s

from kubetrain import settings
from kubetrain.s3_layout import DEFAULT_S3_SECRET
from kubetrain_contract.pod import CHECKPOINT_DIR, DATA_DIR, OUTPUT_DIR, STOP_FILE, Env

CACHE_DIR = "/cache"
BASE_CONTAINER = "base"
STAGE_IN_CONTAINER = "stage-in"
SYNC_CONTAINER = "checkpoint-sync"
GPU_RESOURCE = settings.SETTINGS["gpu_resource"].default
LABEL_PREFIX = "kubetrain.io/"

# STOP_FILE: where the checkpoint-sync sidecar tells the trainer to stop (the median rule of a sweep):
# trainer/sync/README.md, "Median stopping". The sidecar skips ".kubetrain-*" names when it syncs.

STAGE_IN_COMMAND = ("python", "-m", "trainer.sync", "stage-in")
RESTORE_COMMAND = ("python", "-m", "trainer.sync", "restore")
SYNC_COMMAND = ("python", "-m", "trainer.sync", "checkpoint-sync")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(settings.DNS_SUBDOMAIN)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_EXTENDED_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def label_value(value: str) -> str:
    """Turn any string into a valid Kubernetes label value (at most 63 characters).

    Invalid characters become ``-``; a value that had to change or be shortened gets eight
    hex digits of the original's SHA-256, so distinct inputs keep distinct labels.
    """
    value = str(value)
    if _LABEL_VALUE.fullmatch(value) and len(value) <= 63:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:54].strip("-_.")
    return f"{cleaned}-{digest}" if cleaned else digest


# How the API server counts a quantity (k8s.io/apimachinery/pkg/api/resource): memory and storage in
# bytes and CPU in millicores (MilliValue), each as an int64; ParseQuantity silently caps a larger value
# at the int64 maximum and MilliValue overflows, so a value past it is refused here instead.
INT64_MAX = 2**63 - 1
BYTES, MILLICORES, COUNT = "bytes", "millicores", "count"
_UNIT_SCALE = {BYTES: 1, MILLICORES: 1000, COUNT: 1}
# The API server's quantity syntax: a signed decimal number and at most one suffix (binary Ki..Ei,
# decimal n, u, m, k, M..E, or an exponent e<n>); nothing else (no spaces, '_', NaN or Infinity,
# which Python's Decimal would read).
_QUANTITY = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?")


def _quantity(
    name: str,
    value: str | int | float | None,
    expected: str = "e.g. '500m', '2', '4Gi'",
    *,
    unit: str = BYTES,
) -> Decimal | None:
    """The value of a resource quantity (``None`` when unset), checked as the API server would.

    The API server's rules (ValidateResourceQuantityValue in pkg/apis/core/validation, and
    resource.Quantity): its syntax (:data:`_QUANTITY`); greater than zero here (a training pod asks
    for something); at most :data:`INT64_MAX` as Kubernetes counts the resource: ``unit`` ``bytes``
    (memory, ephemeral storage, volume sizes: ``8Ei`` is one too many), ``millicores`` (CPU: at most
    ``9223372036854775807m``, i.e. ``9223372036854775.807`` cores), or ``count`` (extended resources such
    as GPUs: a whole number).
    """
    from kubernetes.utils.quantity import parse_quantity

    if value in (None, ""):
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number or (isinstance(value, str) and _QUANTITY.fullmatch(value))):
        raise ValueError(f"{name}={value!r} is not a Kubernetes quantity: expected {expected}")
    try:
        parsed = parse_quantity(value)
        if not parsed.is_finite():
            raise ValueError("not finite")
    except (ValueError, TypeError, ArithmeticError) as exc:  # ArithmeticError: decimal.Overflow
        raise ValueError(f"{name}={value!r} is not a Kubernetes quantity: expected {expected}") from exc
    if parsed <= 0:
        raise ValueError(f"{name}={value!r} must be greater than zero")
    scale = _UNIT_SCALE[unit]
    # Compared as a Decimal before any rounding: 1e999999 would not fit in memory as an int.
    if parsed > Decimal(INT64_MAX) / scale:
        most = {
            BYTES: f"{INT64_MAX} bytes (just under 8Ei)",
            MILLICORES: f"{INT64_MAX}m ({Decimal(INT64_MAX) / scale} cores)",
            COUNT: str(INT64_MAX),
        }[unit]
        counted = "in units" if unit == COUNT else f"in {unit}"
        raise ValueError(
            f"{name}={value!r} is too large: Kubernetes counts it {counted} as a 64-bit integer, at most {most}"
        )
    if unit == COUNT and parsed != parsed.to_integral_value():
        raise ValueError(f"{name}={value!r} is not a whole number: extended resources are counted in units")
    return parsed


def _dns_name(what: str, value: str, *, subdomain: bool = False) -> str:
    pattern = _DNS_SUBDOMAIN if subdomain else _DNS_LABEL
    if not isinstance(value, str) or not pattern.fullmatch(value):
        kind = "DNS-1123 subdomain" if subdomain else "DNS-1123 label"
        raise ValueError(
            f"{what} {value!r} is not a valid {kind}: expected lower-case letters, digits and '-'"
        )
    return value


def resolve_image(explicit: str | None, kind: str = "trainer") -> str:
    """Return the image reference to run: explicit, else the deployment's setting, else the registry's ``latest``.

    Called when a task runs, never at parse time. The reference may still carry a tag;
    :func:`kubetrain.images.pin_image` turns it into the digest that runs.

    :param explicit: the operator's argument (or a Param), used when set.
    :param kind: ``"trainer"`` or ``"sync"``: the setting ``<kind>_image`` (the Variable
        ``kubetrain_<kind>_image`` that the build DAG sets, or ``KUBETRAIN_<KIND>_IMAGE``), else
        the default name of :func:`kubetrain.imagebuild.products.default_image` in the setting
        ``registry``, of release ``image_tag`` and trainer ``trainer_variant``
        (``<registry>/kubetrain/trainer:<tag>`` or ``...:<tag>-cpu``, ``<registry>/kubetrain/sync:<tag>``).
    """
    from kubetrain.imagebuild.products import DEFAULT_PRODUCTS, default_image

    if kind not in DEFAULT_PRODUCTS:
        raise ValueError(f"unknown image kind {kind!r}: expected one of {', '.join(DEFAULT_PRODUCTS)}")
    if explicit and str(explicit).strip():
        return str(explicit).strip()
    configured = settings.get(f"{kind}_image")
    if configured:
        return configured
    return default_image(
        kind,
        settings.get("registry"),
        settings.get("image_tag") or "latest",
        settings.get("trainer_variant") or "gpu",
    )


def code_version_of(image: str) -> str:
    """The code version an image reference implies: its digest, else its tag, else ``latest``."""
    if "@" in image:
        return image.rsplit("@", 1)[1]
    last = image.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last else "latest"


@dataclass(frozen=True)
class MedianStopping:
    """Median early stopping of one trial of a sweep, done by its checkpoint-sync sidecar.

    :param objective: the metric the trainer reports per epoch (a history.csv column, or a key of
        OUTPUT_DIR/metrics.jsonl), e.g. ``val_accuracy``.
    :param mode: ``max`` or ``min``: whether larger is better.
    :param trials_uri: ``s3://`` prefix of the sweep's finished trial records.
    :param min_trials: finished trials needed before any trial is stopped.
    :param start_step: reports a trial makes before it may be stopped.
    """

    objective: str
    mode: str
    trials_uri: str
    min_trials: int = 3
    start_step: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.objective, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", self.objective):
            raise ValueError(
                f"objective={self.objective!r} is not a metric name: expected e.g. 'val_accuracy'"
            )
        if self.mode not in ("max", "min"):
            raise ValueError(f"mode={self.mode!r} is not valid: expected 'max' or 'min'")
        if (
            not isinstance(self.trials_uri, str)
            or not self.trials_uri.startswith("s3://")
            or not self.trials_uri.endswith("/")
        ):
            raise ValueError(
                f"trials_uri={self.trials_uri!r} is not valid: expected an s3:// prefix ending in '/'"
            )
        object.__setattr__(self, "min_trials", _count("min_trials", self.min_trials, minimum=1))
        object.__setattr__(self, "start_step", _count("start_step", self.start_step, minimum=1))

    def env(self) -> dict[str, str]:
        """The checkpoint-sync sidecar's variables for the rule."""
        return {
            Env.EARLY_STOPPING: "median",
            Env.OBJECTIVE: self.objective,
            Env.OBJECTIVE_MODE: self.mode,
            Env.MEDIAN_MIN_TRIALS: str(self.min_trials),
            Env.MEDIAN_START_STEP: str(self.start_step),
            Env.SWEEP_TRIALS_URI: self.trials_uri,
        }


@dataclass(frozen=True)
class RungStopping:
    """asha or hyperband early stopping of one trial of a sweep, done by its checkpoint-sync sidecar
    (trainer/sync/asha.py).

    :param rule: ``asha`` or ``hyperband``.
    :param objective: the metric the trainer reports per epoch or step.
    :param mode: ``max`` or ``min``: whether larger is better.
    :param trials_uri: ``s3://`` prefix of the sweep's trial records.
    :param rungs_uri: ``s3://`` prefix where the trials' sidecars publish their rung reports.
    :param trial: the trial's number in the sweep.
    :param min_resource: reports at the first rung.
    :param reduction_factor: eta: the top ``1/eta`` of a rung go on.
    :param grace: reports a trial makes before it may be stopped.
    :param max_resource: a trial's reports at full training (no rung at or above it), or ``None``.
    :param brackets: the sweep's Hyperband brackets (1 for asha).
    :param bracket: the trial's bracket (from its number: ``hyperband_bracket``).
    """

    rule: str
    objective: str
    mode: str
    trials_uri: str
    rungs_uri: str
    trial: int
    min_resource: int = 1
    reduction_factor: int = 3
    grace: int = 1
    max_resource: int | None = None
    brackets: int = 1
    bracket: int = 0

    def __post_init__(self) -> None:
        if self.rule not in ("asha", "hyperband"):
            raise ValueError(f"rule={self.rule!r} is not valid: expected 'asha' or 'hyperband'")
        if not isinstance(self.objective, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", self.objective):
            raise ValueError(
                f"objective={self.objective!r} is not a metric name: expected e.g. 'val_accuracy'"
            )
        if self.mode not in ("max", "min"):
            raise ValueError(f"mode={self.mode!r} is not valid: expected 'max' or 'min'")
        for name in ("trials_uri", "rungs_uri"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.startswith("s3://") or not value.endswith("/"):
                raise ValueError(f"{name}={value!r} is not valid: expected an s3:// prefix ending in '/'")
        object.__setattr__(self, "trial", _count("trial", self.trial, minimum=0))
        object.__setattr__(self, "min_resource", _count("min_resource", self.min_resource, minimum=1))
        object.__setattr__(
            self, "reduction_factor", _count("reduction_factor", self.reduction_factor, minimum=2)
        )
        object.__setattr__(self, "grace", _count("grace", self.grace, minimum=1))
        if self.max_resource is not None:
            object.__setattr__(self, "max_resource", _count("max_resource", self.max_resource, minimum=1))
        object.__setattr__(self, "brackets", _count("brackets", self.brackets, minimum=1))
        object.__setattr__(self, "bracket", _count("bracket", self.bracket, minimum=0))
        if self.bracket >= self.brackets:
            raise ValueError(
                f"bracket={self.bracket!r} is not valid: expected 0 to {self.brackets - 1} ({self.brackets} brackets)"
            )

    def env(self) -> dict[str, str]:
        """The checkpoint-sync sidecar's variables for the rule."""
        return {
            Env.EARLY_STOPPING: self.rule,
            Env.OBJECTIVE: self.objective,
            Env.OBJECTIVE_MODE: self.mode,
            Env.SWEEP_TRIALS_URI: self.trials_uri,
            Env.SWEEP_RUNGS_URI: self.rungs_uri,
            Env.SWEEP_TRIAL: str(self.trial),
            Env.ASHA_MIN_RESOURCE: str(self.min_resource),
            Env.ASHA_REDUCTION_FACTOR: str(self.reduction_factor),
            Env.ASHA_GRACE: str(self.grace),
            **({Env.ASHA_MAX_RESOURCE: str(self.max_resource)} if self.max_resource is not None else {}),
            Env.ASHA_BRACKETS: str(self.brackets),
            Env.ASHA_BRACKET: str(self.bracket),
        }


@dataclass(frozen=True)
class TrainingPodConfig:
    """Everything that varies between training pods; checks itself on creation.

    :param image: training image (base container).
    :param sync_image: image with ``python -m trainer.sync`` (stage-in and checkpoint-sync).
    :param run_uri: ``s3://<training>/runs/<dag_id>/<run>``: where checkpoints and output go.
    :param command: base container command (``None``: the image's entrypoint).
    :param args: base container arguments.
    :param dataset_manifest: ``s3://`` URI of the staged dataset manifest, or ``None`` (no dataset).
    :param dataset_version: the manifest's version.
    :param code_version: recorded by trainers in params.json (default: the image tag or digest).
    :param gpus: number of GPUs (request == limit), requested as ``gpu_resource``.
    :param gpu_resource: the extended resource GPUs are requested as: ``nvidia.com/gpu``, a MIG
        profile (``nvidia.com/mig-1g.10gb``), ``amd.com/gpu``, ...
    :param cpu: CPU request of the base container; ``cpu_limit`` defaults to it.
    :param memory: memory request of the base container; ``memory_limit`` defaults to it.
    :param s3_secret: Secret with the AWS_* variables for the sync containers; ``None`` for
        workload identity, which then needs ``service_account_name``.
    :param service_account_name: service account of the pod.
    :param image_pull_secrets: names of registry Secrets.
    :param node_selector: node labels the pod must match.
    :param tolerations: extra tolerations (GPU pods always tolerate their GPU vendor's taint).
    :param run_as_user: numeric non-root user of every container.
    :param sync_interval: seconds between checkpoint-sync passes.
    :param sync_quiet: seconds a file must be unmodified before it is uploaded.
    :param termination_grace_period: seconds the sidecar gets for its final pass on shutdown.
    :param cache_claim: PersistentVolumeClaim for the stage-in cache (keyed by dataset version).
    :param dataset_bytes: the staged manifest's ``total_bytes`` (the stage task's XCom), from which
        the /data volume is sized (:func:`scratch_sizes`); ``None``: unknown.
    :param data_size: ``sizeLimit`` of the /data volume, e.g. ``"50Gi"``, instead of the size derived
        from ``dataset_bytes`` (archives that expand more than :data:`DATA_SIZE_FACTOR` need it).
    :param checkpoint_size: ``sizeLimit`` of the /checkpoints volume when the data size is known.
    :param output_size: ``sizeLimit`` of the /output volume when the data size is known.
    :param env: extra environment of the base container (plain values only, never secrets).
    :param labels: pod labels (values are made label-safe).
    :param annotations: pod annotations.
    :param early_stopping: median, asha or hyperband stopping by the sidecar (a sweep trial), or ``None``.
    """

    image: str
    sync_image: str
    run_uri: str
    command: Sequence[str] | None = None
    args: Sequence[str] | None = None
    dataset_manifest: str | None = None
    dataset_version: str | None = None
    code_version: str | None = None
    gpus: int = 0
    gpu_resource: str = GPU_RESOURCE
    cpu: str = "1"
    memory: str = "2Gi"
    cpu_limit: str | None = None
    memory_limit: str | None = None
    s3_secret: str | None = DEFAULT_S3_SECRET
    service_account_name: str | None = None
    image_pull_secrets: Sequence[str] = ()
    node_selector: Mapping[str, str] | None = None
    tolerations: Sequence[k8s.V1Toleration] = ()
    run_as_user: int = 10001
    sync_interval: int = 30
    sync_quiet: int = 2
    termination_grace_period: int = 300
    cache_claim: str | None = None
    dataset_bytes: int | None = None
    data_size: str | None = None
    checkpoint_size: str = "4Gi"
    output_size: str = "2Gi"
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    namespace: str | None = None
    early_stopping: MedianStopping | RungStopping | None = None

    def __post_init__(self) -> None:
        for name in ("image", "sync_image"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
                raise ValueError(
                    f"{name}={value!r} is not an image reference: expected e.g. registry:5000/kubetrain/trainer:1.0"
                )
        if (
            not isinstance(self.run_uri, str)
            or not self.run_uri.startswith("s3://")
            or self.run_uri.endswith("/")
        ):
            raise ValueError(
                f"run_uri={self.run_uri!r} is not valid: expected s3://<bucket>/<prefix> without a trailing '/'"
            )
        if self.node_selector:  # the API server's label rules, whichever way the mapping came
            settings.parse_node_selector(dict(self.node_selector))
        if self.dataset_manifest is not None and not str(self.dataset_manifest).startswith("s3://"):
            raise ValueError(
                f"dataset_manifest={self.dataset_manifest!r} is not valid: expected an s3:// URI of a manifest"
            )
        object.__setattr__(self, "gpus", _count("gpus", self.gpus, minimum=0))
        if self.gpus:
            _quantity("gpus", self.gpus, unit=COUNT)
        if not isinstance(self.gpu_resource, str) or not _EXTENDED_RESOURCE.match(self.gpu_resource):
            raise ValueError(
                f"gpu_resource={self.gpu_resource!r} is not an extended resource name: expected e.g. "
                "nvidia.com/gpu, nvidia.com/mig-1g.10gb or amd.com/gpu"
            )
        object.__setattr__(self, "tolerations", tuple(_toleration(t) for t in self.tolerations))
        if self.namespace is not None:
            _dns_name("namespace", self.namespace)
        object.__setattr__(self, "run_as_user", _count("run_as_user", self.run_as_user, minimum=1))
        object.__setattr__(self, "sync_interval", _count("sync_interval", self.sync_interval, minimum=1))
        object.__setattr__(self, "sync_quiet", _count("sync_quiet", self.sync_quiet, minimum=0))
        object.__setattr__(
            self,
            "termination_grace_period",
            _count("termination_grace_period", self.termination_grace_period, minimum=1),
        )
        for name, limit_name, unit in (("cpu", "cpu_limit", MILLICORES), ("memory", "memory_limit", BYTES)):
            request = _quantity(name, getattr(self, name), unit=unit)
            if request is None:
                raise ValueError(
                    f"{name} must be set: every container of a training pod has requests and limits"
                )
            limit = _quantity(limit_name, getattr(self, limit_name), unit=unit)
            if limit is not None and limit < request:
                raise ValueError(
                    f"{limit_name}={getattr(self, limit_name)!r} is below {name}={getattr(self, name)!r}: a limit must be >= its request"
                )
        object.__setattr__(self, "dataset_bytes", _dataset_bytes(self.dataset_bytes))
        # a rendered template of an empty Param: "" or "None"
        data_size = None if self.data_size in (None, "", "None", "null") else str(self.data_size).strip()
        object.__setattr__(self, "data_size", data_size)
        for name in ("checkpoint_size", "output_size"):
            if getattr(self, name) in (None, ""):
                raise ValueError(f"{name} must be set: expected a size such as '10Gi'")
            _size(name, getattr(self, name))
        data = _size("data_size", self.data_size)
        if data is not None and self.dataset_bytes is not None and data < self.dataset_bytes:
            raise ValueError(
                f"data_size={self.data_size!r} is smaller than the dataset ({self.dataset_bytes} bytes, the manifest's "
                f"total_bytes): expected at least {_size_text(self.dataset_bytes)}, or empty to derive it "
                f"({_size_text(derived_data_size(self.dataset_bytes))})"
            )
        _check_storage_total(self)
        if self.s3_secret is None and not self.service_account_name:
            raise ValueError(
                "s3_secret=None (workload identity) needs service_account_name: the pod has no other way to reach S3"
            )
        if self.s3_secret is not None:
            _dns_name("s3_secret", self.s3_secret, subdomain=True)
        if self.service_account_name:
            _dns_name("service_account_name", self.service_account_name, subdomain=True)
        for secret in self.image_pull_secrets:
            _dns_name("image pull secret", secret, subdomain=True)
        if self.cache_claim:
            _dns_name("cache_claim", self.cache_claim, subdomain=True)
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"environment variable name {name!r} is not valid")

    @property
    def resolved_code_version(self) -> str:
        return self.code_version or code_version_of(self.image)


def _dataset_bytes(value: object) -> int | None:
    # A Jinja template renders a missing value as "None"; an XComArg arrives as the int itself.
    if value in (None, "", "None", "null"):
        return None
    try:
        number = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < 0:
        raise ValueError(
            f"dataset_bytes={value!r} is not valid: expected the staged manifest's total_bytes, an integer >= 0"
        )
    return number


def _size(name: str, value: str | int | None) -> int | None:
    """Bytes of a volume size such as ``"50Gi"``; at least 1Mi, so that ``"50"`` (bytes) is caught."""
    parsed = _quantity(name, value, "a size such as '50Gi' or '500Mi'")
    if parsed is None:
        return None
    if parsed < MI:
        raise ValueError(f"{name}={value!r} is too small for a volume: expected at least 1Mi, e.g. '50Gi'")
    return math.ceil(parsed)


def _check_storage_total(config: TrainingPodConfig) -> None:
    """The largest ephemeral-storage request (the base container's, :func:`scratch_sizes`) fits an int64 of bytes.

    Each size fits on its own (:func:`_quantity`); their sum, rounded up to a MiB, must too.
    """
    sizes = [_size(n, getattr(config, n)) or 0 for n in ("checkpoint_size", "output_size")]
    data = _size("data_size", config.data_size)
    if data is None and config.dataset_bytes is not None:
        data = derived_data_size(config.dataset_bytes)
    total = -(-((data or 0) + sum(sizes) + BASE_STORAGE) // MI) * MI
    if total > INT64_MAX:
        raise ValueError(
            f"data_size={config.data_size!r} (dataset_bytes={config.dataset_bytes!r}), "
            f"checkpoint_size={config.checkpoint_size!r} and output_size={config.output_size!r} add up to "
            f"{total} bytes of ephemeral-storage: Kubernetes counts it in bytes as a 64-bit integer, at most "
            f"{INT64_MAX}"
        )


def _count(name: str, value: object, *, minimum: int) -> int:
    # Templated operator arguments arrive as strings ("2"); anything else non-integral is refused.
    try:
        number = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name}={value!r} is not valid: expected an integer >= {minimum}")
    return number


# -- named building blocks -----------------------------------------------------------------------


SHM_VOLUME = "dshm"

MI = 1024**2
GI = 1024**3
# The /data volume of a dataset of N bytes (the manifest's total_bytes): DATA_SIZE_FACTOR * N + DATA_SIZE_FLOOR.
# Stage-in (trainer/sync/stagein.py) downloads every object into DATA_DIR first, then extracts the
# archives one by one beside themselves and deletes each only once it is extracted (a copy from the
# cache claim takes the same room), so the peak is the snapshot plus the members extracted so far
# (less the archives already deleted). Twice the snapshot covers archives that expand to at
# most their own size (zips of JPEG/PNG, TFRecords: already compressed, as image datasets are).
# The floor covers what total_bytes does not count: the kubelet measures disk blocks, and a
# dataset of many small files takes a block (4 KiB) per file and directory. ExtractLimits allows
# up to 250x per archive (and 100 GiB), so nothing in the manifest bounds an archive of text or
# CSV (3-10x): such datasets need data_size.
DATA_SIZE_FACTOR = 2
DATA_SIZE_FLOOR = 1 * GI
# Each container's own writes outside the volumes (its writable layer: /tmp, __pycache__; its log):
# the training container's (TensorFlow's temporary files, logs) and each sync container's.
BASE_STORAGE = 1 * GI
SYNC_STORAGE = 256 * MI


def derived_data_size(dataset_bytes: int) -> int:
    """Bytes of the /data volume for a dataset of ``dataset_bytes``, rounded up to a MiB."""
    need = DATA_SIZE_FACTOR * dataset_bytes + DATA_SIZE_FLOOR
    return -(-need // MI) * MI


def _size_text(nbytes: int) -> str:
    """A Kubernetes quantity for ``nbytes``: whole GiB as ``Gi``, else MiB rounded up."""
    if nbytes % GI == 0:
        return f"{nbytes // GI}Gi"
    return f"{-(-nbytes // MI)}Mi"


@dataclass(frozen=True)
class ScratchSizes:
    """The pod's local storage: each emptyDir's ``sizeLimit`` and each container's ``ephemeral-storage``.

    ``data`` is ``None`` when the dataset's size is unknown (no ``dataset_bytes``, no ``data_size``):
    the volumes then have no ``sizeLimit`` and the containers a request but no limit.
    """

    data: str | None
    checkpoints: str | None
    output: str | None
    base: str
    stage_in: str
    sync: str
    limited: bool


def scratch_sizes(config: TrainingPodConfig) -> ScratchSizes:
    """The sizes of ``config``'s volumes and the ``ephemeral-storage`` of its containers.

    /data is ``data_size`` if set, else derived from ``dataset_bytes`` (:func:`derived_data_size`);
    /checkpoints and /output are ``checkpoint_size`` and ``output_size``. The kubelet counts
    disk-backed emptyDirs against the pod's ephemeral storage, whose request (and limit) is the sum
    of its containers' (for init containers, the larger of theirs and the running pod's), so:

    - base: /data + /checkpoints + /output + BASE_STORAGE (its own writes);
    - stage-in (init container, alone while it runs): /data + /checkpoints + SYNC_STORAGE;
    - checkpoint-sync (sidecar; it only reads the volumes, and its stop file is in /checkpoints): SYNC_STORAGE.

    The pod then requests base + checkpoint-sync: all the node must hold. Limits equal requests, so
    one runaway volume is evicted with its own message instead of filling the node.

    Without a known data size the volumes keep no ``sizeLimit`` and the containers no limit, as
    before; the requests are still set (the same sums with /data counted as 0), so that the node
    holds at least the checkpoints and output and GKE Autopilot does not apply its small default.
    """
    checkpoints = _size("checkpoint_size", config.checkpoint_size)
    output = _size("output_size", config.output_size)
    data = _size("data_size", config.data_size)
    if data is None and config.dataset_bytes is not None:
        data = derived_data_size(config.dataset_bytes)
    known = data is not None
    data_bytes = data or 0
    return ScratchSizes(
        data=(config.data_size or _size_text(data_bytes)) if known else None,
        checkpoints=config.checkpoint_size if known else None,
        output=config.output_size if known else None,
        base=_size_text(data_bytes + checkpoints + output + BASE_STORAGE),
        stage_in=_size_text(data_bytes + checkpoints + SYNC_STORAGE),
        sync=_size_text(SYNC_STORAGE),
        limited=known,
    )


def _with_storage(
    resources: k8s.V1ResourceRequirements, size: str, limited: bool
) -> k8s.V1ResourceRequirements:
    resources.requests["ephemeral-storage"] = size
    if limited:
        resources.limits["ephemeral-storage"] = size
    return resources


def needs_shm(config: TrainingPodConfig) -> bool:
    """More than one GPU in the pod: NCCL's all-reduce between them goes through /dev/shm, whose 64 MiB container
    default starves it, so the pod gets a memory-backed one."""
    return config.gpus > 1


def scratch_volumes(config: TrainingPodConfig) -> list[k8s.V1Volume]:
    """The emptyDir volumes for /data, /checkpoints and /output (plus the cache claim, and /dev/shm for several
    GPUs)."""
    sizes = scratch_sizes(config)
    volumes = [
        k8s.V1Volume(name=name, empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=getattr(sizes, name)))
        for name in ("data", "checkpoints", "output")
    ]
    if needs_shm(config):
        # counted against the container's memory limit, as memory-backed emptyDirs are, not against its
        # ephemeral storage: at most its memory
        volumes.append(
            k8s.V1Volume(
                name=SHM_VOLUME,
                empty_dir=k8s.V1EmptyDirVolumeSource(
                    medium="Memory", size_limit=config.memory_limit or config.memory
                ),
            )
        )
    if config.cache_claim:
        volumes.append(
            k8s.V1Volume(
                name="dataset-cache",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                    claim_name=config.cache_claim
                ),
            )
        )
    return volumes


def pod_security_context(config: TrainingPodConfig) -> k8s.V1PodSecurityContext:
    """Pod-wide: numeric non-root user and group, volumes group-writable by it, default seccomp."""
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=config.run_as_user,
        run_as_group=config.run_as_user,
        fs_group=config.run_as_user,
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def container_security_context(config: TrainingPodConfig) -> k8s.V1SecurityContext:
    """Per container: no root, no privilege escalation, no capabilities."""
    return k8s.V1SecurityContext(
        run_as_non_root=True,
        run_as_user=config.run_as_user,
        allow_privilege_escalation=False,
        privileged=False,
        capabilities=k8s.V1Capabilities(drop=["ALL"]),
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def base_resources(config: TrainingPodConfig) -> k8s.V1ResourceRequirements:
    """Requests and limits of the base container; GPUs are extended resources, so request == limit."""
    requests = {"cpu": str(config.cpu), "memory": str(config.memory)}
    limits = {"cpu": str(config.cpu_limit or config.cpu), "memory": str(config.memory_limit or config.memory)}
    if config.gpus:
        requests[config.gpu_resource] = limits[config.gpu_resource] = str(config.gpus)
    sizes = scratch_sizes(config)
    return _with_storage(
        k8s.V1ResourceRequirements(requests=requests, limits=limits), sizes.base, sizes.limited
    )


def _helper_resources(config: TrainingPodConfig, cpu: tuple[str, str], memory: tuple[str, str], storage: str):
    """Requests and limits of a transfer container: (request, limit) of CPU and memory, and its disk."""
    return _with_storage(
        k8s.V1ResourceRequirements(
            requests={"cpu": cpu[0], "memory": memory[0]}, limits={"cpu": cpu[1], "memory": memory[1]}
        ),
        storage,
        scratch_sizes(config).limited,
    )


def stage_in_resources(config: TrainingPodConfig) -> k8s.V1ResourceRequirements:
    # Archive extraction is CPU-bound and streams; memory stays small.
    return _helper_resources(config, ("250m", "1"), ("256Mi", "1Gi"), scratch_sizes(config).stage_in)


def sync_resources(config: TrainingPodConfig) -> k8s.V1ResourceRequirements:
    return _helper_resources(config, ("100m", "500m"), ("128Mi", "512Mi"), scratch_sizes(config).sync)


def gpu_tolerations(gpus: int, gpu_resource: str = GPU_RESOURCE) -> list[k8s.V1Toleration]:
    """The taints GPU node pools carry, tolerated by GPU pods.

    Pools are tainted with the GPU vendor's ``<domain>/gpu`` (``nvidia.com/gpu``, ``amd.com/gpu``)
    or with the resource name itself; a pod that requests a MIG profile such as
    ``nvidia.com/mig-1g.10gb`` tolerates both.
    """
    if not gpus:
        return []
    keys = [gpu_resource]
    vendor = f"{gpu_resource.split('/', 1)[0]}/gpu"
    if vendor not in keys:
        keys.append(vendor)
    return [k8s.V1Toleration(key=key, operator="Exists", effect="NoSchedule") for key in keys]


def _toleration(value: k8s.V1Toleration | Mapping[str, object]) -> k8s.V1Toleration:
    """A checked V1Toleration, whichever way it came (a Param's JSON, a dict, an object): the settings' rules."""
    if isinstance(value, k8s.V1Toleration):
        value = {
            k8s.V1Toleration.attribute_map[a]: getattr(value, a)
            for a in k8s.V1Toleration.attribute_map
            if getattr(value, a) is not None
        }
    if not isinstance(value, Mapping):
        raise ValueError(f"toleration {value!r} is not a V1Toleration or a mapping of its fields")
    (checked,) = settings.parse_tolerations([dict(value)])
    fields = {"tolerationSeconds": "toleration_seconds"}
    return k8s.V1Toleration(**{fields.get(k, k): v for k, v in checked.items()})


def pod_tolerations(config: TrainingPodConfig) -> list[k8s.V1Toleration] | None:
    """The GPU tolerations and the extra ones, each once."""
    found: list[k8s.V1Toleration] = []
    for toleration in [*gpu_tolerations(config.gpus, config.gpu_resource), *config.tolerations]:
        if toleration not in found:
            found.append(toleration)
    return found or None


def contract_env(config: TrainingPodConfig) -> list[k8s.V1EnvVar]:
    """The pod contract's environment, the same in every container (no secrets in it)."""
    values = {
        Env.DATA_DIR: DATA_DIR,
        Env.CHECKPOINT_DIR: CHECKPOINT_DIR,
        Env.OUTPUT_DIR: OUTPUT_DIR,
        Env.RUN_URI: config.run_uri,
        Env.IMAGE: config.image,
        Env.CODE_VERSION: config.resolved_code_version,
    }
    if config.dataset_manifest:
        values[Env.DATASET_MANIFEST] = config.dataset_manifest
    if config.dataset_version:
        values[Env.DATASET_VERSION] = config.dataset_version
    return [k8s.V1EnvVar(name=k, value=v) for k, v in values.items()]


def s3_env_from(config: TrainingPodConfig) -> list[k8s.V1EnvFromSource]:
    """AWS_* variables from the S3 Secret, by reference; empty for workload identity."""
    if config.s3_secret is None:
        return []
    return [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=config.s3_secret))]


def _mount(name: str, path: str, *, read_only: bool = False) -> k8s.V1VolumeMount:
    return k8s.V1VolumeMount(name=name, mount_path=path, read_only=read_only or None)


def stage_in_container(config: TrainingPodConfig) -> k8s.V1Container:
    """Init container: download the dataset snapshot and this run's latest checkpoints.

    Without a dataset (a trainer that fetches nothing) it only restores the checkpoints.
    """
    env = contract_env(config)
    mounts = [_mount("data", DATA_DIR), _mount("checkpoints", CHECKPOINT_DIR)]
    if config.cache_claim:
        env.append(k8s.V1EnvVar(name=Env.CACHE_DIR, value=CACHE_DIR))
        mounts.append(_mount("dataset-cache", CACHE_DIR))
    return k8s.V1Container(
        name=STAGE_IN_CONTAINER,
        image=config.sync_image,
        command=list(STAGE_IN_COMMAND if config.dataset_manifest else RESTORE_COMMAND),
        env=env,
        env_from=s3_env_from(config),
        volume_mounts=mounts,
        resources=stage_in_resources(config),
        security_context=container_security_context(config),
    )


# One termination grace period covers the trainer's SIGTERM checkpoint and, after it, the
# sidecar's final pass (native sidecars get SIGTERM only once the main container has exited):
# the trainer may take a quarter of it (at most 60 s), the sidecar the rest less a margin
# for its pass manifest before the kubelet's SIGKILL (trainer/sync/README.md).
TRAINER_SHARE_MAX = 60
SYNC_MARGIN = 10
# what the final pass needs besides the upload: start-up listing, settle, the manifest
FINAL_PASS_FIXED = 5


def sync_grace(termination_grace_period: int) -> int:
    """Seconds the sidecar's final pass may take, counted from its own SIGTERM."""
    trainer_share = min(TRAINER_SHARE_MAX, termination_grace_period // 4)
    return max(1, termination_grace_period - trainer_share - SYNC_MARGIN)


def grace_period_for(checkpoint_bytes: int, sync_bytes_per_second: float = 20e6) -> int:
    """The smallest pod grace period (at least 30 s) whose final pass uploads a checkpoint of
    ``checkpoint_bytes`` at ``sync_bytes_per_second`` (a conservative rate of one sidecar to S3)."""
    if checkpoint_bytes < 0 or not sync_bytes_per_second > 0:
        raise ValueError(
            f"checkpoint_bytes={checkpoint_bytes!r} and sync_bytes_per_second={sync_bytes_per_second!r}: "
            "expected a size >= 0 and a rate > 0"
        )
    need = -(-checkpoint_bytes // int(sync_bytes_per_second)) + FINAL_PASS_FIXED
    grace = 30
    while sync_grace(grace) < need:
        grace += 1
    return grace


def stop_env(config: TrainingPodConfig, *, rule: bool = True) -> list[k8s.V1EnvVar]:
    """``KUBETRAIN_STOP_FILE`` (and, for the sidecar, the rule's settings) when the trial may be stopped early."""
    if config.early_stopping is None:
        return []
    values = {Env.STOP_FILE: STOP_FILE, **(config.early_stopping.env() if rule else {})}
    return [k8s.V1EnvVar(name=k, value=v) for k, v in values.items()]


def checkpoint_sync_container(config: TrainingPodConfig) -> k8s.V1Container:
    """Native sidecar (``restartPolicy: Always`` init container): upload checkpoints and output."""
    env = [
        *contract_env(config),
        k8s.V1EnvVar(name=Env.SYNC_INTERVAL, value=str(config.sync_interval)),
        k8s.V1EnvVar(name=Env.SYNC_QUIET, value=str(config.sync_quiet)),
        k8s.V1EnvVar(name=Env.SYNC_GRACE, value=str(sync_grace(config.termination_grace_period))),
        # A native sidecar gets its SIGTERM only once every main container has exited (at the pod's
        # end, and on deletion or eviction since Kubernetes 1.29, the oldest kubetrain supports), so
        # no writer is left when its final pass starts: the settle period, which waits for a file a
        # trainer may still be writing, would only add its 0.5 s to every run's and trial's end.
        k8s.V1EnvVar(name=Env.SYNC_SETTLE, value="0"),
        *stop_env(config),
        # The pod name goes into every pass manifest.
        k8s.V1EnvVar(
            name=Env.HOSTNAME,
            value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="metadata.name")),
        ),
    ]
    return k8s.V1Container(
        name=SYNC_CONTAINER,
        image=config.sync_image,
        command=list(SYNC_COMMAND),
        restart_policy="Always",
        env=env,
        env_from=s3_env_from(config),
        # The sidecar only reads what the trainer writes; with early stopping it may also
        # write the stop file into CHECKPOINT_DIR.
        volume_mounts=[
            _mount("checkpoints", CHECKPOINT_DIR, read_only=config.early_stopping is None),
            _mount("output", OUTPUT_DIR, read_only=True),
        ],
        resources=sync_resources(config),
        security_context=container_security_context(config),
    )


def base_container(config: TrainingPodConfig) -> k8s.V1Container:
    """The training container: the image and command, the contract's directories and environment."""
    env = (
        contract_env(config)
        + stop_env(config, rule=False)
        + [k8s.V1EnvVar(name=k, value=str(v)) for k, v in config.env.items()]
    )
    return k8s.V1Container(
        name=BASE_CONTAINER,
        image=config.image,
        command=list(config.command) if config.command else None,
        args=[str(a) for a in config.args] if config.args else None,
        env=env,
        volume_mounts=[
            _mount("data", DATA_DIR),
            _mount("checkpoints", CHECKPOINT_DIR),
            _mount("output", OUTPUT_DIR),
            *([_mount(SHM_VOLUME, "/dev/shm")] if needs_shm(config) else []),
        ],
        resources=base_resources(config),
        security_context=container_security_context(config),
        termination_message_policy="FallbackToLogsOnError",
    )


def pod_labels(config: TrainingPodConfig) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/component": "training"}
    labels.update({k: label_value(v) for k, v in config.labels.items()})
    return labels


def training_pod(
    config: TrainingPodConfig, *, name: str | None = None, namespace: str | None = None
) -> k8s.V1Pod:
    """The whole training pod of ``config``.

    :param config: the pod's settings.
    :param name: pod name (the KubernetesPodOperator sets its own when ``None``).
    :param namespace: namespace (default: ``config.namespace``; the connection's when both are ``None``).
    """
    annotations = {"kubetrain.io/run-uri": config.run_uri, **config.annotations}
    if config.dataset_manifest:
        annotations["kubetrain.io/dataset-manifest"] = config.dataset_manifest
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace=namespace or config.namespace,
            labels=pod_labels(config),
            annotations=annotations,
        ),
        spec=k8s.V1PodSpec(
            restart_policy="Never",
            init_containers=[stage_in_container(config), checkpoint_sync_container(config)],
            containers=[base_container(config)],
            volumes=scratch_volumes(config),
            security_context=pod_security_context(config),
            service_account_name=config.service_account_name,
            # Only workload identity needs the projected token; nothing else talks to the API.
            automount_service_account_token=bool(config.service_account_name and config.s3_secret is None),
            image_pull_secrets=[k8s.V1LocalObjectReference(name=s) for s in config.image_pull_secrets]
            or None,
            node_selector=dict(config.node_selector) if config.node_selector else None,
            tolerations=pod_tolerations(config),
            termination_grace_period_seconds=config.termination_grace_period,
        ),
    )


# -- replicas of a multi-worker job (kubetrain.distributed) ---------------------------------------


def replica_pod_template(
    config: TrainingPodConfig,
    *,
    sync: bool,
    env: Mapping[str, str] | None = None,
    ports: Sequence[k8s.V1ContainerPort] = (),
    labels: Mapping[str, str] | None = None,
    subdomain: str | None = None,
    restart_policy: str = "Never",
    container_name: str = BASE_CONTAINER,
) -> k8s.V1PodTemplateSpec:
    """The pod template of one replica of a multi-worker job: the training pod contract per replica.

    Every replica gets the stage-in init container (the dataset, and the run's checkpoints, which
    are the chief's: only the chief syncs), the base container with ``env`` added (the cluster
    variables) and ``ports``; only the chief (``sync``) gets the checkpoint-sync sidecar.

    :param config: the replica's settings (its role's resources).
    :param sync: whether this replica's pod has the checkpoint-sync sidecar (the chief).
    :param env: plain variables added to the base container.
    :param ports: container ports of the base container (the TensorFlow server's).
    :param labels: labels added to the pod's.
    :param subdomain: the headless Service the pod's hostname lives under.
    :param restart_policy: the pod's restart policy.
    :param container_name: the base container's name (a TFJob's must be ``tensorflow``).
    """
    base = base_container(config)
    base.name = container_name
    base.env = [*(base.env or []), *(k8s.V1EnvVar(name=k, value=str(v)) for k, v in (env or {}).items())]
    base.ports = list(ports) or None
    init = [stage_in_container(config)] + ([checkpoint_sync_container(config)] if sync else [])
    annotations = {"kubetrain.io/run-uri": config.run_uri, **config.annotations}
    if config.dataset_manifest:
        annotations["kubetrain.io/dataset-manifest"] = config.dataset_manifest
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(
            labels={**pod_labels(config), **{k: label_value(v) for k, v in (labels or {}).items()}},
            annotations=annotations,
        ),
        spec=k8s.V1PodSpec(
            restart_policy=restart_policy,
            init_containers=init,
            containers=[base],
            volumes=scratch_volumes(config),
            security_context=pod_security_context(config),
            service_account_name=config.service_account_name,
            automount_service_account_token=bool(config.service_account_name and config.s3_secret is None),
            image_pull_secrets=[k8s.V1LocalObjectReference(name=s) for s in config.image_pull_secrets]
            or None,
            node_selector=dict(config.node_selector) if config.node_selector else None,
            tolerations=pod_tolerations(config),
            termination_grace_period_seconds=config.termination_grace_period,
            subdomain=subdomain,
        ),
    )
