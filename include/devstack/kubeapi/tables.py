"""Server-side printing (``meta.k8s.io/v1 Table``), which ``kubectl get`` asks for."""

from __future__ import annotations

import time

from include.devstack.kubeapi.meta import human_duration, parse_time


def _age(obj: dict) -> str:
    ts = obj.get("metadata", {}).get("creationTimestamp")
    return human_duration(time.time() - parse_time(ts)) if ts else "<unknown>"


def _col(name: str, type_: str = "string", priority: int = 0, fmt: str = "", description: str = "") -> dict:
    return {
        "name": name,
        "type": type_,
        "format": fmt,
        "description": description or name,
        "priority": priority,
    }


def pod_status_reason(pod: dict) -> tuple[str, int, int, int, int]:
    """kubectl's STATUS column (printPod): (reason, ready, total, restarts, last-restart-age)."""
    spec, status = pod.get("spec", {}), pod.get("status", {})
    reason = status.get("reason") or status.get("phase") or "Pending"
    restarts = 0
    total = len(spec.get("containers") or [])
    ready = 0
    sidecars = {c["name"] for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"}
    total += len(sidecars)
    initializing = False
    init_statuses = status.get("initContainerStatuses") or []
    for i, cs in enumerate(init_statuses):
        restarts += cs.get("restartCount", 0)
        state = cs.get("state") or {}
        if cs["name"] in sidecars:
            if cs.get("ready"):
                ready += 1
            if cs.get("started"):
                continue
        term, wait = state.get("terminated"), state.get("waiting")
        if term and term.get("exitCode") == 0:
            continue
        if term:
            reason = "Init:" + (
                term.get("reason")
                or (f"Signal:{term['signal']}" if term.get("signal") else f"ExitCode:{term.get('exitCode')}")
            )
        elif wait and wait.get("reason") and wait["reason"] != "PodInitializing":
            reason = "Init:" + wait["reason"]
        else:
            reason = f"Init:{i}/{len(spec.get('initContainers') or [])}"
        initializing = True
        break
    if not initializing:
        restarts = sum(cs.get("restartCount", 0) for cs in init_statuses if cs["name"] in sidecars)
        has_running = False
        for cs in reversed(status.get("containerStatuses") or []):
            restarts += cs.get("restartCount", 0)
            state = cs.get("state") or {}
            wait, term = state.get("waiting"), state.get("terminated")
            if wait and wait.get("reason"):
                reason = wait["reason"]
            elif term and term.get("reason"):
                reason = term["reason"]
            elif term:
                reason = (
                    f"Signal:{term['signal']}" if term.get("signal") else f"ExitCode:{term.get('exitCode')}"
                )
            elif cs.get("ready") and state.get("running"):
                has_running = True
                ready += 1
        if reason == "Completed" and has_running:
            ready_cond = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
            )
            reason = "Running" if ready_cond else "NotReady"
    if pod.get("metadata", {}).get("deletionTimestamp"):
        reason = "Terminating"
    return reason, ready, total, restarts, 0


def pod_row(pod: dict) -> list:
    reason, ready, total, restarts, _ = pod_status_reason(pod)
    status = pod.get("status", {})
    return [
        pod["metadata"]["name"],
        f"{ready}/{total}",
        reason,
        restarts,
        _age(pod),
        status.get("podIP") or "<none>",
        pod.get("spec", {}).get("nodeName") or "<none>",
        "<none>",
        "<none>",
    ]


POD_COLUMNS = [
    _col("Name", fmt="name"),
    _col("Ready"),
    _col("Status"),
    _col("Restarts", "string"),
    _col("Age"),
    _col("IP", priority=1),
    _col("Node", priority=1),
    _col("Nominated Node", priority=1),
    _col("Readiness Gates", priority=1),
]


def job_row(job: dict) -> list:
    spec, status = job.get("spec", {}), job.get("status", {})
    conds = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Complete" in conds:
        state = "Complete"
    elif "Failed" in conds:
        state = "Failed"
    elif "FailureTarget" in conds:
        state = "FailureTarget"
    elif "SuccessCriteriaMet" in conds:
        state = "SuccessCriteriaMet"
    elif "Suspended" in conds:
        state = "Suspended"
    elif job.get("metadata", {}).get("deletionTimestamp"):
        state = "Terminating"
    else:
        state = "Running"
    completions = spec.get("completions")
    comp = (
        f"{status.get('succeeded', 0)}/{completions}"
        if completions is not None
        else f"{status.get('succeeded', 0)}/1 of {spec.get('parallelism', 1)}"
    )
    duration = ""
    if status.get("startTime"):
        end = parse_time(status["completionTime"]) if status.get("completionTime") else time.time()
        duration = human_duration(end - parse_time(status["startTime"]))
    template = spec.get("template", {}).get("spec", {})
    names = ",".join(c["name"] for c in template.get("containers") or [])
    images = ",".join(c.get("image", "") for c in template.get("containers") or [])
    selector = ",".join(f"{k}={v}" for k, v in (spec.get("selector") or {}).get("matchLabels", {}).items())
    return [job["metadata"]["name"], state, comp, duration, _age(job), names, images, selector]


JOB_COLUMNS = [
    _col("Name", fmt="name"),
    _col("Status"),
    _col("Completions"),
    _col("Duration"),
    _col("Age"),
    _col("Containers", priority=1),
    _col("Images", priority=1),
    _col("Selector", priority=1),
]


def event_row(ev: dict) -> list:
    inv = ev.get("involvedObject", {})
    last = ev.get("lastTimestamp") or ev.get("eventTime") or ev["metadata"].get("creationTimestamp")
    first = ev.get("firstTimestamp") or last
    seen = human_duration(time.time() - parse_time(last)) if last else "<unknown>"
    obj = f"{inv.get('kind', '').lower()}/{inv.get('name', '')}"
    src = ev.get("source", {})
    source = src.get("component", "") + (f", {src['host']}" if src.get("host") else "")
    return [
        seen,
        ev.get("type", ""),
        ev.get("reason", ""),
        obj,
        ev.get("message", ""),
        inv.get("fieldPath", ""),
        source,
        human_duration(time.time() - parse_time(first)) if first else "",
        ev.get("count", 1),
        ev["metadata"]["name"],
    ]


EVENT_COLUMNS = [
    _col("Last Seen"),
    _col("Type"),
    _col("Reason"),
    _col("Object"),
    _col("Message"),
    _col("Subobject", priority=1),
    _col("Source", priority=1),
    _col("First Seen", priority=1),
    _col("Count", "integer", priority=1),
    _col("Name", priority=1),
]


def secret_row(obj: dict) -> list:
    return [obj["metadata"]["name"], obj.get("type", "Opaque"), len(obj.get("data") or {}), _age(obj)]


def configmap_row(obj: dict) -> list:
    return [obj["metadata"]["name"], len(obj.get("data") or {}) + len(obj.get("binaryData") or {}), _age(obj)]


def namespace_row(obj: dict) -> list:
    return [obj["metadata"]["name"], obj.get("status", {}).get("phase", "Active"), _age(obj)]


def node_row(obj: dict) -> list:
    roles = ",".join(
        k.split("/", 1)[1]
        for k in obj["metadata"].get("labels", {})
        if k.startswith("node-role.kubernetes.io/")
    )
    info = obj.get("status", {}).get("nodeInfo", {})
    return [
        obj["metadata"]["name"],
        "Ready",
        roles or "<none>",
        _age(obj),
        info.get("kubeletVersion", ""),
        "127.0.0.1",
        "<none>",
        info.get("osImage", ""),
        info.get("kernelVersion", ""),
        info.get("containerRuntimeVersion", ""),
    ]


def service_row(obj: dict) -> list:
    spec = obj.get("spec") or {}
    ports = (
        ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or []) or "<none>"
    )
    selector = ",".join(f"{k}={v}" for k, v in sorted((spec.get("selector") or {}).items())) or "<none>"
    return [
        obj["metadata"]["name"],
        spec.get("type", "ClusterIP"),
        spec.get("clusterIP", "None"),
        "<none>",
        ports,
        _age(obj),
        selector,
    ]


TABLES = {
    "services": (
        [
            _col("Name", fmt="name"),
            _col("Type"),
            _col("Cluster-IP"),
            _col("External-IP"),
            _col("Port(s)"),
            _col("Age"),
            _col("Selector", priority=1),
        ],
        service_row,
    ),
    "pods": (POD_COLUMNS, pod_row),
    "jobs": (JOB_COLUMNS, job_row),
    "events": (EVENT_COLUMNS, event_row),
    "secrets": ([_col("Name", fmt="name"), _col("Type"), _col("Data", "integer"), _col("Age")], secret_row),
    "configmaps": ([_col("Name", fmt="name"), _col("Data", "integer"), _col("Age")], configmap_row),
    "namespaces": ([_col("Name", fmt="name"), _col("Status"), _col("Age")], namespace_row),
    "nodes": (
        [
            _col("Name", fmt="name"),
            _col("Status"),
            _col("Roles"),
            _col("Age"),
            _col("Version"),
            _col("Internal-IP", priority=1),
            _col("External-IP", priority=1),
            _col("OS-Image", priority=1),
            _col("Kernel-Version", priority=1),
            _col("Container-Runtime", priority=1),
        ],
        node_row,
    ),
}


def table(
    resource: str, items: list[dict], include_object: str, resource_version: str, with_columns: bool = True
) -> dict:
    columns, row = TABLES.get(
        resource, ([_col("Name", fmt="name"), _col("Age")], lambda o: [o["metadata"]["name"], _age(o)])
    )
    rows = []
    for obj in items:
        entry: dict = {"cells": row(obj)}
        if include_object == "Object":
            entry["object"] = obj
        elif include_object != "None":
            entry["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            }
        rows.append(entry)
    out = {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "rows": rows,
    }
    out["columnDefinitions"] = columns if with_columns else []
    return out
