"""The numbers of a training pod: quantities and counts checked as Kubernetes reads them, the local
storage sized from the dataset, and the termination grace period shared by the trainer and the sidecar.

:mod:`kubetrain.pod_spec` turns them into ``kubernetes.client`` models; nothing here builds one.

Local storage (:func:`scratch_sizes`): the emptyDirs get ``sizeLimit``s and the containers that write to
them an ``ephemeral-storage`` request (and, when the dataset's size is known, an equal limit) that add up
to what the node must hold, so that the scheduler places the pod where its dataset fits and the kubelet
does not evict it under disk pressure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubetrain.pod_spec import TrainingPodConfig

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


def quantity(
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


def checked_int(name: str, value: object, *, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``; templated operator arguments arrive as strings ("2"),
    anything else non-integral (a bool, a float, "two") is refused naming the value."""
    try:
        number = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name}={value!r} is not valid: expected an integer >= {minimum}")
    return number


# -- local storage -------------------------------------------------------------------------------

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


def byte_count_of(name: str, value: object, expected: str) -> int | None:
    """A count of bytes as given to the pod's settings (an int, or a rendered template's text); ``None``:
    unknown. ``expected`` says what the value is, for the error naming a bad one."""
    # A Jinja template renders a missing value as "None"; an XComArg arrives as the int itself.
    if value in (None, "", "None", "null"):
        return None
    try:
        number = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < 0:
        raise ValueError(f"{name}={value!r} is not valid: expected {expected}, an integer >= 0")
    return number


def dataset_bytes_of(value: object) -> int | None:
    """The staged manifest's ``total_bytes`` as given to the pod's settings; ``None``: unknown."""
    return byte_count_of("dataset_bytes", value, "the staged manifest's total_bytes")


def prepared_bytes_given(value: object) -> int | None:
    """The prepared copy's size as given to the pod's settings (:func:`prepared_bytes_of`); ``None``: none."""
    return byte_count_of(
        "prepared_bytes", value, "the prepared copy's bytes (kubetrain.pod_sizing.prepared_bytes_of)"
    )


def size_bytes(name: str, value: str | int | None) -> int | None:
    """Bytes of a volume size such as ``"50Gi"``; at least 1Mi, so that ``"50"`` (bytes) is caught."""
    parsed = quantity(name, value, "a size such as '50Gi' or '500Mi'")
    if parsed is None:
        return None
    if parsed < MI:
        raise ValueError(f"{name}={value!r} is too small for a volume: expected at least 1Mi, e.g. '50Gi'")
    return math.ceil(parsed)


def size_text(nbytes: int) -> str:
    """A Kubernetes quantity for ``nbytes``: whole GiB as ``Gi``, else MiB rounded up."""
    if nbytes % GI == 0:
        return f"{nbytes // GI}Gi"
    return f"{-(-nbytes // MI)}Mi"


# One record of a prepared image copy (trainer/image_classifier/prepare.py): an 8-byte header and the
# resized pixels; 150,536 bytes (about 147 KiB) per image at 224 px RGB, often 10x the JPEG it came from.
PREPARED_HEADER_BYTES = 8


def prepared_bytes_of(images: int, image_size: int, channels: int = 3) -> int:
    """Bytes of the prepared copy of ``images`` images at ``image_size`` px: what the trainer (or the stage-in,
    downloading it) adds to /data in ``.kubetrain-prepared``."""
    return images * (PREPARED_HEADER_BYTES + image_size * image_size * channels)


def derived_data_size(dataset_bytes: int, prepared_bytes: int = 0) -> int:
    """Bytes of the /data volume for a dataset of ``dataset_bytes`` and its prepared copy, rounded up to a MiB."""
    need = DATA_SIZE_FACTOR * dataset_bytes + prepared_bytes + DATA_SIZE_FLOOR
    return -(-need // MI) * MI


def check_sizes(config: TrainingPodConfig) -> None:
    """Refuse volume sizes the pod cannot have, naming the value.

    ``checkpoint_size`` and ``output_size`` are set sizes; ``data_size``, when set, holds at least the
    dataset; and the largest ``ephemeral-storage`` request (the base container's, :func:`scratch_sizes`),
    rounded up to a MiB, fits an int64 of bytes, as each size does on its own (:func:`quantity`).
    """
    for name in ("checkpoint_size", "output_size"):
        if getattr(config, name) in (None, ""):
            raise ValueError(f"{name} must be set: expected a size such as '10Gi'")
        size_bytes(name, getattr(config, name))
    data = size_bytes("data_size", config.data_size)
    if data is not None and config.dataset_bytes is not None and data < config.dataset_bytes:
        raise ValueError(
            f"data_size={config.data_size!r} is smaller than the dataset ({config.dataset_bytes} bytes, the "
            f"manifest's total_bytes): expected at least {size_text(config.dataset_bytes)}, or empty to derive it "
            f"({size_text(derived_data_size(config.dataset_bytes))})"
        )
    if data is None and config.dataset_bytes is not None:
        data = derived_data_size(config.dataset_bytes, config.prepared_bytes or 0)
    sizes = [size_bytes(n, getattr(config, n)) or 0 for n in ("checkpoint_size", "output_size")]
    total = -(-((data or 0) + sum(sizes) + BASE_STORAGE) // MI) * MI
    if total > INT64_MAX:
        raise ValueError(
            f"data_size={config.data_size!r} (dataset_bytes={config.dataset_bytes!r}), "
            f"checkpoint_size={config.checkpoint_size!r} and output_size={config.output_size!r} add up to "
            f"{total} bytes of ephemeral-storage: Kubernetes counts it in bytes as a 64-bit integer, at most "
            f"{INT64_MAX}"
        )


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
    checkpoints = size_bytes("checkpoint_size", config.checkpoint_size)
    output = size_bytes("output_size", config.output_size)
    if checkpoints is None:
        raise ValueError(
            f"checkpoint_size={config.checkpoint_size!r} is not valid: expected a size such as '4Gi'"
        )
    if output is None:
        raise ValueError(f"output_size={config.output_size!r} is not valid: expected a size such as '2Gi'")
    data = size_bytes("data_size", config.data_size)
    if data is None and config.dataset_bytes is not None:
        data = derived_data_size(config.dataset_bytes, config.prepared_bytes or 0)
    known = data is not None
    data_bytes = data or 0
    return ScratchSizes(
        data=(config.data_size or size_text(data_bytes)) if known else None,
        checkpoints=config.checkpoint_size if known else None,
        output=config.output_size if known else None,
        base=size_text(data_bytes + checkpoints + output + BASE_STORAGE),
        stage_in=size_text(data_bytes + checkpoints + SYNC_STORAGE),
        sync=size_text(SYNC_STORAGE),
        limited=known,
    )


# -- the termination grace period ----------------------------------------------------------------

# One termination grace period covers the trainer's SIGTERM checkpoint and, after it, the
# sidecar's final pass (native sidecars get SIGTERM only once the main container has exited):
# the trainer may take a quarter of it (at most 60 s), the sidecar the rest less a margin
# for its pass manifest before the kubelet's SIGKILL (trainer/sync/README.md).
TRAINER_SHARE_MAX = 60
SYNC_MARGIN = 10


def sync_grace(termination_grace_period: int) -> int:
    """Seconds the sidecar's final pass may take, counted from its own SIGTERM."""
    trainer_share = min(TRAINER_SHARE_MAX, termination_grace_period // 4)
    return max(1, termination_grace_period - trainer_share - SYNC_MARGIN)
