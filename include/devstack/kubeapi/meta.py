"""API errors, timestamps and the table of served resources."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

# The oldest Kubernetes minor kubetrain supports (native sidecars, restartPolicy: Always on init containers,
# are on by default since 1.29): the local API reports it and serves its schemas, so that nothing newer works
# here that would fail on such a cluster. `--kubernetes-version` reports another (the preflight's tests).
MINIMUM_MINOR = 29
SERVER_VERSION = {
    "major": "1",
    "minor": str(MINIMUM_MINOR),
    "gitVersion": f"v1.{MINIMUM_MINOR}.0-kubetrain",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
NODE_NAME = "kubetrain-dev"


def set_version(version: str) -> None:
    """Report Kubernetes ``version`` (``1.28``, ``1.29.3``) as this server's and its kubelet's."""
    parts = version.removeprefix("v").split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:3]):
        raise ValueError(f"invalid Kubernetes version {version!r}: expected major.minor[.patch], e.g. 1.29")
    patch = parts[2] if len(parts) > 2 else "0"
    SERVER_VERSION.update(
        major=parts[0], minor=parts[1], gitVersion=f"v{parts[0]}.{parts[1]}.{patch}-kubetrain"
    )


NODE_IP = "127.0.0.1"


class ApiError(Exception):
    """An error answered as a ``meta/v1 Status`` object, as the real API server does."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        kind: str | None = None,
        name: str | None = None,
        group: str = "",
        causes: list[dict] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details: dict = {}
        if name is not None:
            self.details["name"] = name
        if group:
            self.details["group"] = group
        if kind is not None:
            self.details["kind"] = kind
        if causes:
            self.details["causes"] = causes

    def status(self) -> dict:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(404, "NotFound", f'{qualified} "{name}" not found', kind=resource, name=name, group=group)


def already_exists(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(
        409, "AlreadyExists", f'{qualified} "{name}" already exists', kind=resource, name=name, group=group
    )


def conflict(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        kind=resource,
        name=name,
        group=group,
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(kind: str, name: str, causes: list[tuple[str, str, str]], group: str = "") -> ApiError:
    """422 Invalid; ``causes`` are (field, reason, message) as in ``field.ErrorList``."""
    parts = [f"{fld}: {msg}" for fld, _, msg in causes]
    summary = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    qualified = f"{kind}.{group}" if group else kind
    return ApiError(
        422,
        "Invalid",
        f'{qualified} "{name}" is invalid: {summary}',
        kind=kind,
        name=name,
        group=group,
        causes=[{"reason": reason, "message": msg, "field": fld} for fld, reason, msg in causes],
    )


# -- time ------------------------------------------------------------------------------------


def now_ns() -> int:
    return time.time_ns()


def rfc3339(ts: float | None = None) -> str:
    """Second-precision RFC 3339, as ``metav1.Time`` serialises."""
    dt = datetime.fromtimestamp(time.time() if ts is None else ts, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_micro(ts: float | None = None) -> str:
    """Microsecond-precision RFC 3339, as ``metav1.MicroTime`` serialises."""
    dt = datetime.fromtimestamp(time.time() if ts is None else ts, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339_nano(ns: int) -> str:
    """Go's ``time.RFC3339Nano`` in UTC: trailing zeros of the fraction are dropped, as the kubelet writes."""
    secs, frac = divmod(ns, 1_000_000_000)
    base = datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    digits = f"{frac:09d}".rstrip("0")
    return f"{base}.{digits}Z" if digits else f"{base}Z"


def parse_time_ns(value: str) -> int:
    """Parse an RFC 3339 timestamp (any fraction precision, ``Z`` or offset) to exact epoch nanoseconds."""
    text = value.strip()
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    main, sep, rest = text.partition(".")
    digits, tz = "", ""
    if sep:
        i = 0
        while i < len(rest) and rest[i].isdigit():
            i += 1
        digits, tz = rest[:i], rest[i:]
        text = main + tz
    try:
        dt = datetime.fromisoformat(text)
    except ValueError as exc:
        raise bad_request(f'invalid time "{value}": expected RFC 3339, e.g. 2006-01-02T15:04:05Z') from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    whole = int((dt - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds())
    return whole * 1_000_000_000 + int((digits + "000000000")[:9])


def parse_time(value: str) -> float:
    """Parse an RFC 3339 timestamp to epoch seconds."""
    return parse_time_ns(value) / 1e9


def human_duration(seconds: float) -> str:
    """``duration.HumanDuration`` from apimachinery, as kubectl shows ages."""
    s = int(seconds)
    if s < 0:
        return "<invalid>"
    if s < 60 * 2:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        rem = s % 60
        return f"{minutes}m{rem}s" if rem else f"{minutes}m"
    if minutes < 60 * 3:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rem = minutes % 60
        return f"{hours}h{rem}m" if rem else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rem = hours % 24
        return f"{hours // 24}d{rem}h" if rem else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    return f"{hours // 24 // 365}y"


# -- resources -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    """One served resource type."""

    name: str  # plural, e.g. "pods"
    kind: str
    group: str  # "" for core
    version: str
    namespaced: bool
    verbs: tuple[str, ...]
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()


CRUD = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
RESOURCES: dict[tuple[str, str], Resource] = {}


def _register(res: Resource) -> None:
    RESOURCES[(res.group, res.name)] = res


_register(
    Resource(
        "pods",
        "Pod",
        "",
        "v1",
        True,
        CRUD,
        ("po",),
        ("all",),
        {
            "log": ("get",),
            "exec": ("create", "get"),
            "attach": ("create", "get"),
            "status": ("get", "patch", "update"),
            "eviction": ("create",),
        },
    )
)
_register(Resource("events", "Event", "", "v1", True, CRUD, ("ev",)))
_register(Resource("secrets", "Secret", "", "v1", True, CRUD))
_register(Resource("configmaps", "ConfigMap", "", "v1", True, CRUD, ("cm",)))
_register(
    Resource(
        "namespaces",
        "Namespace",
        "",
        "v1",
        False,
        ("create", "delete", "get", "list", "patch", "update", "watch"),
        ("ns",),
        (),
        {"status": ("get", "patch", "update")},
    )
)
_register(
    Resource("nodes", "Node", "", "v1", False, ("get", "list", "watch"), ("no",), (), {"status": ("get",)})
)
_register(
    Resource(
        "jobs",
        "Job",
        "batch",
        "v1",
        True,
        CRUD,
        (),
        ("all",),
        {"status": ("get", "patch", "update")},
    )
)
_register(Resource("events", "Event", "events.k8s.io", "v1", True, ("get", "list", "watch"), ("ev",)))
# headless Services only (no kube-proxy): the names of an Indexed Job's pods, as cluster DNS gives them
_register(
    Resource(
        "services",
        "Service",
        "",
        "v1",
        True,
        CRUD,
        ("svc",),
        ("all",),
        {"status": ("get", "patch", "update")},
    )
)
# no custom resources are served: the list is empty, so clients see that no CRD (TFJob, TrainJob) exists
_register(
    Resource(
        "customresourcedefinitions",
        "CustomResourceDefinition",
        "apiextensions.k8s.io",
        "v1",
        False,
        ("get", "list", "watch"),
        ("crd", "crds"),
        ("api-extensions",),
        {"status": ("get",)},
    )
)

# RBAC (authorized by kubeapi/rbac.py), the service accounts it names, and the access reviews clients ask
_register(Resource("serviceaccounts", "ServiceAccount", "", "v1", True, CRUD, ("sa",)))
for _name, _kind, _namespaced in (
    ("roles", "Role", True),
    ("rolebindings", "RoleBinding", True),
    ("clusterroles", "ClusterRole", False),
    ("clusterrolebindings", "ClusterRoleBinding", False),
):
    _register(Resource(_name, _kind, "rbac.authorization.k8s.io", "v1", _namespaced, CRUD))
_register(
    Resource(
        "selfsubjectaccessreviews",
        "SelfSubjectAccessReview",
        "authorization.k8s.io",
        "v1",
        False,
        ("create",),
    )
)
_register(
    Resource(
        "selfsubjectrulesreviews",
        "SelfSubjectRulesReview",
        "authorization.k8s.io",
        "v1",
        False,
        ("create",),
    )
)

GROUPS = {
    "batch": "v1",
    "events.k8s.io": "v1",
    "apiextensions.k8s.io": "v1",
    "rbac.authorization.k8s.io": "v1",
    "authorization.k8s.io": "v1",
}
# the versions a group serves beside its preferred one in GROUPS (a CRD with several served versions, whose
# objects are converted on the way out), newest first
ALSO_SERVED: dict[str, tuple[str, ...]] = {}
SERVED_SUMMARY = (
    "pods, pods/log, pods/exec, pods/attach (output only), pods/eviction, events, secrets, configmaps, namespaces, nodes, services (headless), "
    "serviceaccounts, jobs.batch, roles, rolebindings, clusterroles and clusterrolebindings "
    "(rbac.authorization.k8s.io), selfsubjectaccessreviews and selfsubjectrulesreviews "
    "(authorization.k8s.io), customresourcedefinitions.apiextensions.k8s.io (read-only, none defined) and, "
    "with the Kueue stand-in, localqueues, clusterqueues, workloadpriorityclasses, resourceflavors and "
    "workloads (read-only) in kueue.x-k8s.io v1beta2 and v1beta1"
)


def served_versions(group: str) -> tuple[str, ...]:
    """The versions ``group`` serves, the preferred first (none when it is not served)."""
    if group == "":
        return ("v1",)
    return (GROUPS[group], *ALSO_SERVED.get(group, ())) if group in GROUPS else ()


def resource_for(group: str, version: str, name: str) -> Resource:
    res = RESOURCES.get((group, name))
    if res is not None and version != res.version and version in served_versions(group):
        return replace(res, version=version)
    if res is None or version not in served_versions(group):
        gv = f"{group}/{version}" if group else version
        raise ApiError(
            404,
            "NotFound",
            f"the server could not find the requested resource ({name} in {gv}): "
            f"the local Kubernetes API serves {SERVED_SUMMARY}",
        )
    return res


def unsupported_group(group: str, version: str | None = None) -> ApiError:
    """404 for an API group the local server does not serve (apps, metrics.k8s.io, kubeflow.org, ...)."""
    gv = f"{group}/{version}" if version else group
    return ApiError(
        404,
        "NotFound",
        f"the server could not find the requested resource: the local Kubernetes API "
        f"does not serve {gv}; it serves {SERVED_SUMMARY}",
    )
