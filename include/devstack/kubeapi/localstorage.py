"""Local ephemeral storage, measured and enforced as a kubelet's eviction manager does (localStorageEviction).

Every :data:`MONITORING_PERIOD` seconds the local kubelet measures each running pod (kubelet.py) and,
in upstream's order, evicts it when

1. a disk-backed emptyDir (no ``medium``) holds more than its ``sizeLimit``:
   ``Usage of EmptyDir volume "data" exceeds the limit "1Mi". ``;
2. the pod's local storage (its containers' writable layers and logs, its disk-backed emptyDir and
   configMap volumes, its ``/etc/hosts``) exceeds the pod's ``ephemeral-storage`` limit, the sum of its
   containers' as the scheduler sums them: ``Pod ephemeral local storage usage exceeds the total limit
   of containers 2Mi. ``;
3. one (main) container's writable layer and logs exceed its own limit:
   ``Container main exceeded its local ephemeral storage limit "2Mi". ``.

Memory-backed emptyDirs count against the container's memory instead, as on a node. The figures
are ``du``'s (allocated blocks, hard links once, one file system), as the kubelet's volume and
container-layer statistics; one ``du`` process measures a pod's paths (:func:`disk_usage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from include.devstack.kubeapi.validation import parse_quantity

# the kubelet's evictionMonitoringPeriod (pkg/kubelet/kubelet.go)
MONITORING_PERIOD = 10.0
# the grace period of a local-storage eviction (immediateEvictionGracePeriodSeconds)
EVICTION_GRACE = 1.0

EMPTY_DIR_MESSAGE = 'Usage of EmptyDir volume "{}" exceeds the limit "{}". '
POD_MESSAGE = "Pod ephemeral local storage usage exceeds the total limit of containers {}. "
CONTAINER_MESSAGE = 'Container {} exceeded its local ephemeral storage limit "{}". '


# -- quantities, printed as resource.Quantity's String() -----------------------------------------


@dataclass(frozen=True)
class Quantity:
    """A byte count and the format its first spelling gave it (BinarySI, DecimalSI, DecimalExponent)."""

    value: int
    format: str

    @classmethod
    def parse(cls, text: object) -> Quantity:
        spelled = str(text).strip()
        if spelled.endswith("i"):
            fmt = "BinarySI"
        elif re.search(r"[eE][+-]?[0-9]+$", spelled):
            fmt = "DecimalExponent"
        else:
            fmt = "DecimalSI"
        value = parse_quantity(spelled)
        return cls(int(value.to_integral_value(rounding="ROUND_CEILING")), fmt)

    def __add__(self, other: Quantity) -> Quantity:
        return Quantity(self.value + other.value, self.format)  # Add keeps the receiver's format

    def __str__(self) -> str:
        return canonical(self.value, self.format)


def canonical(value: int, fmt: str) -> str:
    """A whole number of bytes as resource.Quantity's canonical String() in format ``fmt``."""
    if fmt == "BinarySI" and -1024 < value < 1024:
        fmt = "DecimalSI"  # as CanonicalizeBytes: small binary values print as decimals
    if value == 0:
        return "0"
    if fmt == "BinarySI":
        exponent = 0
        while exponent < 6 and value % 1024 == 0:
            value //= 1024
            exponent += 1
        return f"{value}{('', 'Ki', 'Mi', 'Gi', 'Ti', 'Pi', 'Ei')[exponent]}"
    exponent = 0
    while exponent < 18 and value % 1000 == 0:
        value //= 1000
        exponent += 3
    if fmt == "DecimalExponent":
        return f"{value}e{exponent}" if exponent else str(value)
    return f"{value}{('', 'k', 'M', 'G', 'T', 'P', 'E')[exponent // 3]}"


def _limit(container: dict) -> Quantity | None:
    raw = ((container.get("resources") or {}).get("limits") or {}).get("ephemeral-storage")
    return Quantity.parse(raw) if raw is not None else None


def pod_limit(spec: dict) -> Quantity | None:
    """The pod's ``ephemeral-storage`` limit as PodLimits sums it: its containers' and sidecars', or an init
    container's with the sidecars started before it when larger; None when no container sets one."""

    def add(a: Quantity | None, b: Quantity | None) -> Quantity | None:
        return b if a is None else a if b is None else a + b

    total: Quantity | None = None
    for c in spec.get("containers") or []:
        total = add(total, _limit(c))
    sidecars: Quantity | None = None
    peak: Quantity | None = None
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            total = add(total, _limit(c))
            sidecars = add(sidecars, _limit(c))
        elif _limit(c) is not None:
            alone = add(_limit(c), sidecars)
            peak = alone if peak is None or alone.value > peak.value else peak
    if peak is not None and (total is None or peak.value > total.value):
        return peak
    return total


def disk_backed_empty_dir(volume: dict) -> bool:
    """An emptyDir on the node's disk (IsLocalEphemeralVolume): Memory and HugePages media are not."""
    return "emptyDir" in volume and not (volume.get("emptyDir") or {}).get("medium")


# -- measuring -------------------------------------------------------------------------------


async def disk_usage(paths: list[Path]) -> dict[Path, int]:
    """Bytes allocated under each of ``paths``: one ``du -s -x -B1`` (GNU coreutils) for them all.

    du's figures are the kubelet's (allocated blocks, each hard-linked inode once, one file system), and
    in a process of its own the walk neither holds this server's GIL nor blocks its event loop. A path
    that is missing, or that vanishes during the walk, is absent from the result (0 to the caller).
    """
    if not paths:
        return {}
    proc = await asyncio.create_subprocess_exec(
        "du",
        "-s",
        "-x",
        "-B1",
        "--",
        *(os.fspath(p) for p in paths),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        out, _ = await proc.communicate()
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    wanted = {os.fspath(p): p for p in paths}
    found: dict[Path, int] = {}
    for line in out.decode(errors="surrogateescape").splitlines():
        size, _, name = line.partition("\t")
        if name in wanted and size.isdigit():
            found[wanted[name]] = int(size)
    return found


def _unescape(field_: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def overlay_upperdir(mountpoint: Path, mountinfo: str | None = None) -> Path | None:
    """The writable layer (``upperdir``) of the overlay mounted at ``mountpoint``; None if it is not one."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    found = None
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3 or _unescape(fields[4]) != str(mountpoint):
            continue
        if after[0] != "overlay":
            found = None  # a later mount over it hides the overlay
            continue
        for option in after[2].split(","):
            if option.startswith("upperdir="):
                found = Path(_unescape(option[len("upperdir=") :]))
    return found


@dataclass
class Usage:
    """One measurement of a pod: bytes per volume, per container (writable layer, logs), and the rest
    of the pod's local storage (its /etc/hosts)."""

    volumes: dict[str, int] = field(default_factory=dict)
    rootfs: dict[str, int] = field(default_factory=dict)
    logs: dict[str, int] = field(default_factory=dict)
    other: int = 0

    def pod_total(self, spec: dict) -> int:
        local = {
            v["name"]
            for v in spec.get("volumes") or []
            if disk_backed_empty_dir(v) or "configMap" in v or "gitRepo" in v
        }
        volumes = sum(b for name, b in self.volumes.items() if name in local)
        return volumes + sum(self.rootfs.values()) + sum(self.logs.values()) + self.other


def eviction_message(spec: dict, usage: Usage) -> str | None:
    """Why the eviction manager would evict a pod of ``spec`` using ``usage``; None when it would not.

    The three checks of localStorageEviction in upstream's order: emptyDir sizeLimits, the pod's
    total limit, then each main container's limit (its writable layer and logs; init containers
    and sidecars have no check of their own).
    """
    for volume in spec.get("volumes") or []:
        size = (volume.get("emptyDir") or {}).get("sizeLimit")
        if not disk_backed_empty_dir(volume) or size is None:
            continue
        limit = Quantity.parse(size)
        used = usage.volumes.get(volume["name"])
        if used is not None and limit.value > 0 and used > limit.value:
            return EMPTY_DIR_MESSAGE.format(volume["name"], limit)
    total = pod_limit(spec)
    if total is not None and usage.pod_total(spec) > total.value:
        return POD_MESSAGE.format(total)
    for c in spec.get("containers") or []:
        limit = _limit(c)
        if limit is None or limit.value == 0 or c["name"] not in usage.rootfs | usage.logs:
            continue
        if usage.rootfs.get(c["name"], 0) + usage.logs.get(c["name"], 0) > limit.value:
            return CONTAINER_MESSAGE.format(c["name"], limit)
    return None


def wants_measuring(spec: dict) -> bool:
    """Whether anything in ``spec`` limits local storage (an emptyDir sizeLimit or an ephemeral-storage limit)."""
    if any(
        disk_backed_empty_dir(v) and (v.get("emptyDir") or {}).get("sizeLimit")
        for v in spec.get("volumes") or []
    ):
        return True
    containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
    return any(_limit(c) is not None for c in containers)
