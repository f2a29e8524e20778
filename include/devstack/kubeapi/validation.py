"""Defaulting and validation of the served kinds, with the field paths and messages of the real API server."""

from __future__ import annotations

import json
import random
import re
from decimal import Decimal, InvalidOperation

from include.devstack.kubeapi.meta import ApiError, invalid

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
SUPPORTED_VOLUMES = ("emptyDir", "secret", "configMap", "hostPath", "downwardAPI", "projected")
Causes = list[tuple[str, str, str]]


def generate_name(prefix: str) -> str:
    # the same alphabet as k8s.io/apiserver's name generator (no vowels, no confusable digits)
    return prefix + "".join(random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))


def req(causes: Causes, path: str) -> None:
    causes.append((path, "FieldValueRequired", "Required value"))


def bad(causes: Causes, path: str, value: object, why: str) -> None:
    shown = f'"{value}"' if isinstance(value, str) else repr(value)
    causes.append((path, "FieldValueInvalid", f"Invalid value: {shown}: {why}"))


def unsupported(causes: Causes, path: str, value: object, allowed: tuple[str, ...]) -> None:
    quoted = ", ".join(f'"{a}"' for a in allowed)
    causes.append(
        (path, "FieldValueNotSupported", f'Unsupported value: "{value}": supported values: {quoted}')
    )


def check_name(causes: Causes, value: str, path: str = "metadata.name", label: bool = False) -> None:
    if label:
        if len(value) > 63:
            bad(causes, path, value, "must be no more than 63 characters")
        elif not DNS1123_LABEL.match(value):
            bad(causes, path, value, LABEL_MSG)
    elif len(value) > 253:
        bad(causes, path, value, "must be no more than 253 characters")
    elif not DNS1123_SUBDOMAIN.match(value):
        bad(causes, path, value, SUBDOMAIN_MSG)


def check_metadata(causes: Causes, meta: dict, label_name: bool = False) -> None:
    name = meta.get("name")
    if not name:
        causes.append(
            ("metadata.name", "FieldValueRequired", "Required value: name or generateName is required")
        )
    else:
        check_name(causes, name, label=label_name)
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, base = key.rpartition("/")
        if (prefix and not DNS1123_SUBDOMAIN.match(prefix)) or not LABEL_NAME.match(base) or len(base) > 63:
            bad(
                causes,
                "metadata.labels",
                key,
                "name part must consist of alphanumeric characters, '-', '_' "
                "or '.', and must start and end with an alphanumeric character",
            )
        if not isinstance(value, str):
            bad(causes, f"metadata.labels[{key}]", value, "label values must be strings")
        elif value and (len(value) > 63 or not LABEL_NAME.match(value)):
            bad(
                causes,
                "metadata.labels",
                value,
                "a valid label must be an empty string or consist of "
                "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
            )
    for key, value in (meta.get("annotations") or {}).items():
        if not isinstance(value, str):
            bad(causes, f"metadata.annotations[{key}]", value, "annotation values must be strings")


# -- quantities ------------------------------------------------------------------------------

_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def parse_quantity(value: object) -> Decimal:
    """A resource.Quantity string (``500m``, ``2Gi``, ``1``) as a Decimal."""
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(
            f"quantities must match the regular expression '{_QUANTITY.pattern}', got \"{text}\""
        )
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ValueError(f'invalid quantity "{text}"') from None
    return number * Decimal(_SUFFIX[m.group(2) or ""])


# -- pods ------------------------------------------------------------------------------------


def default_container(c: dict) -> None:
    image = c.get("image") or ""
    if "imagePullPolicy" not in c:
        tag = image.rsplit("/", 1)[-1]
        c["imagePullPolicy"] = (
            "Always" if (":" not in tag or tag.endswith(":latest")) and "@" not in image else "IfNotPresent"
        )
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("resources", {})
    res = c["resources"]
    # extended resources (nvidia.com/gpu) may set only limits; requests default to limits
    for k, v in (res.get("limits") or {}).items():
        res.setdefault("requests", {}).setdefault(k, v)
    for port in c.get("ports") or []:
        port.setdefault("protocol", "TCP")


def default_pod_spec(spec: dict) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    spec.setdefault("priority", 0)
    if spec.get("serviceAccountName") or spec.get("serviceAccount"):
        spec["serviceAccountName"] = spec.get("serviceAccountName") or spec["serviceAccount"]
    else:
        spec["serviceAccountName"] = "default"
    spec["serviceAccount"] = spec["serviceAccountName"]
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        default_container(c)
    for v in spec.get("volumes") or []:
        for kind in ("secret", "configMap", "downwardAPI"):
            if isinstance(v.get(kind), dict):
                v[kind].setdefault("defaultMode", 0o644)
        if isinstance(v.get("projected"), dict):
            v["projected"].setdefault("defaultMode", 0o644)
        if isinstance(v.get("hostPath"), dict):
            v["hostPath"].setdefault("type", "")


def validate_pod(pod: dict) -> None:
    meta, spec = pod.get("metadata", {}), pod.get("spec")
    causes: Causes = []
    check_metadata(causes, meta)
    if not isinstance(spec, dict):
        req(causes, "spec")
        raise invalid("Pod", meta.get("name", ""), causes)
    validate_pod_spec(causes, spec, "spec")
    if spec.get("ephemeralContainers"):
        causes.append(
            ("spec.ephemeralContainers", "FieldValueForbidden", "Forbidden: cannot be set on create")
        )
    if causes:
        raise invalid("Pod", meta.get("name", ""), causes)


def validate_security_context(causes: Causes, sc: object, path: str) -> None:
    """kube-apiserver's ValidateSecurityContext: no_new_privs (allowPrivilegeEscalation: false) cannot hold
    for a privileged container, nor for one given CAP_SYS_ADMIN. Validation, so it applies in every namespace,
    before (and whatever) Pod Security admission decides."""
    if not isinstance(sc, dict) or sc.get("allowPrivilegeEscalation") is not False:
        return
    shown = json.dumps(sc, separators=(",", ":"), sort_keys=True)
    if sc.get("privileged") is True:
        causes.append(
            (
                f"{path}.securityContext",
                "FieldValueInvalid",
                f"Invalid value: {shown}: cannot set `allowPrivilegeEscalation` to false and "
                "`privileged` to true",
            )
        )
    caps = sc.get("capabilities")
    for cap in (caps.get("add") or []) if isinstance(caps, dict) else []:
        if cap == "CAP_SYS_ADMIN":
            causes.append(
                (
                    f"{path}.securityContext",
                    "FieldValueInvalid",
                    f"Invalid value: {shown}: cannot set `allowPrivilegeEscalation` to false and "
                    "`capabilities.Add` CAP_SYS_ADMIN",
                )
            )


def validate_pod_spec(causes: Causes, spec: dict, path: str) -> None:
    volumes = {}
    for i, v in enumerate(spec.get("volumes") or []):
        vpath = f"{path}.volumes[{i}]"
        name = v.get("name", "")
        if not name:
            req(causes, f"{vpath}.name")
        else:
            check_name(causes, name, f"{vpath}.name", label=True)
            if name in volumes:
                causes.append((f"{vpath}.name", "FieldValueDuplicate", f'Duplicate value: "{name}"'))
        volumes[name] = v
        sources = [k for k in v if k != "name"]
        if len(sources) != 1:
            causes.append(
                (vpath, "FieldValueRequired", "Required value: must specify exactly one volume type")
            )
        elif sources[0] not in SUPPORTED_VOLUMES:
            unsupported(causes, f"{vpath}.{sources[0]}", sources[0], SUPPORTED_VOLUMES)
    policy = spec.get("restartPolicy", "Always")
    if policy not in ("Always", "OnFailure", "Never"):
        unsupported(causes, f"{path}.restartPolicy", policy, ("Always", "OnFailure", "Never"))
    containers = spec.get("containers")
    if not containers:
        req(causes, f"{path}.containers")
    names: set[str] = set()
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            validate_container(
                causes, c, f"{path}.{field}[{i}]", volumes, names, init=field == "initContainers"
            )
    # ephemeral containers are added through pods/ephemeralcontainers (not served here), but their security
    # context is validated wherever they appear, as kube-apiserver's validateContainerCommon does
    for i, c in enumerate(spec.get("ephemeralContainers") or []):
        if isinstance(c, dict):
            validate_security_context(causes, c.get("securityContext"), f"{path}.ephemeralContainers[{i}]")
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and (not isinstance(grace, int) or grace < 0):
        bad(causes, f"{path}.terminationGracePeriodSeconds", grace, "must be greater than or equal to 0")
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and (not isinstance(deadline, int) or deadline <= 0):
        bad(causes, f"{path}.activeDeadlineSeconds", deadline, "must be greater than or equal to 1")
    gates = spec.get("schedulingGates")
    if gates is not None:
        if not isinstance(gates, list):
            bad(causes, f"{path}.schedulingGates", gates, "must be a list of {name: ...}")
            return
        seen: set[str] = set()
        for i, gate in enumerate(gates):
            gname = gate.get("name", "") if isinstance(gate, dict) else ""
            if not gname:
                req(causes, f"{path}.schedulingGates[{i}].name")
            elif not LABEL_NAME.match(gname.split("/")[-1]) or gname.count("/") > 1:
                bad(
                    causes,
                    f"{path}.schedulingGates[{i}].name",
                    gname,
                    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
                    "and end with an alphanumeric character",
                )
            elif gname in seen:
                causes.append(
                    (
                        f"{path}.schedulingGates[{i}].name",
                        "FieldValueDuplicate",
                        f'Duplicate value: "{gname}"',
                    )
                )
            seen.add(gname)


def validate_container(
    causes: Causes, c: dict, path: str, volumes: dict, names: set[str], init: bool
) -> None:
    name = c.get("name", "")
    if not name:
        req(causes, f"{path}.name")
    else:
        check_name(causes, name, f"{path}.name", label=True)
        if name in names:
            causes.append((f"{path}.name", "FieldValueDuplicate", f'Duplicate value: "{name}"'))
        names.add(name)
    if not (c.get("image") or "").strip():
        req(causes, f"{path}.image")
    validate_security_context(causes, c.get("securityContext"), path)
    rp = c.get("restartPolicy")
    if rp is not None and (not init or rp != "Always"):
        if init:
            unsupported(causes, f"{path}.restartPolicy", rp, ("Always",))
        else:
            causes.append(
                (
                    f"{path}.restartPolicy",
                    "FieldValueForbidden",
                    "Forbidden: may not be set for non-init containers",
                )
            )
    if init and rp != "Always":
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if c.get(probe):
                causes.append(
                    (
                        f"{path}.{probe}",
                        "FieldValueForbidden",
                        "Forbidden: may not be set for init containers without restartPolicy=Always",
                    )
                )
    mounts: set[str] = set()
    for j, m in enumerate(c.get("volumeMounts") or []):
        mpath = f"{path}.volumeMounts[{j}]"
        vname = m.get("name", "")
        if not vname:
            req(causes, f"{mpath}.name")
        elif vname not in volumes:
            causes.append((f"{mpath}.name", "FieldValueNotFound", f'Not found: "{vname}"'))
        mount_path = m.get("mountPath", "")
        if not mount_path:
            req(causes, f"{mpath}.mountPath")
        elif not mount_path.startswith("/"):
            bad(causes, f"{mpath}.mountPath", mount_path, "must be an absolute path in the local runtime")
        elif mount_path in mounts:
            bad(causes, f"{mpath}.mountPath", mount_path, "must be unique")
        mounts.add(mount_path)
        sub = m.get("subPath", "")
        if sub and (sub.startswith("/") or ".." in sub.split("/")):
            bad(causes, f"{mpath}.subPath", sub, "must be a relative path without '..'")
    env_names: set[str] = set()
    for j, e in enumerate(c.get("env") or []):
        epath = f"{path}.env[{j}]"
        ename = e.get("name", "")
        if not ename:
            req(causes, f"{epath}.name")
        elif not ENV_NAME.match(ename):
            bad(
                causes,
                f"{epath}.name",
                ename,
                "a valid environment variable name must consist of alphabetic "
                "characters, digits, '_', '-', or '.', and must not start with a digit",
            )
        env_names.add(ename)
        src = e.get("valueFrom")
        if src is not None:
            if e.get("value"):
                bad(causes, f"{epath}.valueFrom", "", "may not be specified when `value` is not empty")
            kinds = [
                k for k in ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef") if src.get(k)
            ]
            if len(kinds) != 1:
                bad(causes, f"{epath}.valueFrom", "", "may not have more than one field specified at a time")
            elif kinds[0] == "fieldRef":
                fp = src["fieldRef"].get("fieldPath", "")
                if not FIELD_REF.match(fp):
                    unsupported(causes, f"{epath}.valueFrom.fieldRef.fieldPath", fp, FIELD_REF_PATHS)
    resources = c.get("resources") or {}
    for kind in ("limits", "requests"):
        for rname, q in (resources.get(kind) or {}).items():
            try:
                parse_quantity(q)
            except ValueError as exc:
                bad(causes, f"{path}.resources.{kind}[{rname}]", q, str(exc))
    gpu_req = (resources.get("requests") or {}).get("nvidia.com/gpu")
    gpu_lim = (resources.get("limits") or {}).get("nvidia.com/gpu")
    if gpu_req is not None and gpu_lim is None:
        causes.append(
            (
                f"{path}.resources.limits",
                "FieldValueRequired",
                "Required value: Limit must be set for non overcommitable resources",
            )
        )
    elif gpu_req is not None and str(gpu_req) != str(gpu_lim):
        bad(
            causes,
            f"{path}.resources.requests",
            str(gpu_req),
            f"must be equal to nvidia.com/gpu limit of {gpu_lim}",
        )


FIELD_REF_PATHS = (
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "metadata.labels['<KEY>']",
    "metadata.annotations['<KEY>']",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.hostIP",
    "status.hostIPs",
    "status.podIP",
    "status.podIPs",
    "metadata.labels",
    "metadata.annotations",
)
FIELD_REF = re.compile(
    r"^(metadata\.(name|namespace|uid|labels|annotations)|metadata\.(labels|annotations)\['[^']+'\]"
    r"|spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$"
)

# Fields of a running pod that an update may change (the rest of the spec is immutable).
MUTABLE_POD_SPEC = ("activeDeadlineSeconds", "tolerations")


def validate_pod_update(old: dict, new: dict) -> None:
    name = old["metadata"]["name"]
    check_immutable_meta(old, new, "Pod")
    causes: Causes = []
    check_metadata(causes, new.get("metadata", {}))
    os_, ns_ = dict(old.get("spec") or {}), dict(new.get("spec") or {})
    for key in MUTABLE_POD_SPEC:
        os_.pop(key, None)
        ns_.pop(key, None)
    # Scheduling gates may only be removed; while a pod is gated its nodeSelector may gain entries (what
    # Kueue does when it admits a pod onto a flavor).
    old_gates = [g.get("name") for g in os_.pop("schedulingGates", None) or []]
    new_gates = [g.get("name") for g in ns_.pop("schedulingGates", None) or []]
    added = [g for g in new_gates if g not in old_gates]
    if added:
        causes.append(
            (
                "spec.schedulingGates",
                "FieldValueForbidden",
                f"Forbidden: only deletion is allowed, but found new scheduling gate '{added[0]}'",
            )
        )
    if old_gates:
        old_sel, new_sel = os_.pop("nodeSelector", None) or {}, ns_.pop("nodeSelector", None) or {}
        if any(new_sel.get(k) != v for k, v in old_sel.items()):
            causes.append(
                (
                    "spec.nodeSelector",
                    "FieldValueInvalid",
                    "Invalid value: only additions to spec.nodeSelector are allowed while the pod is gated",
                )
            )
    if os_ != ns_:
        causes.append(
            (
                "spec",
                "FieldValueForbidden",
                "Forbidden: pod updates may not change fields other than "
                "`spec.activeDeadlineSeconds` or `spec.tolerations` (only additions to existing "
                "tolerations); the local Kubernetes API does not update container images in place",
            )
        )
    if causes:
        raise invalid("Pod", name, causes)


def _same_time(a: str, b: str) -> bool:
    from include.devstack.kubeapi.meta import parse_time_ns

    try:
        return parse_time_ns(str(a)) == parse_time_ns(str(b))
    except Exception:  # noqa: BLE001 - not a time: compared as text by the caller
        return False


def check_immutable_meta(old: dict, new: dict, kind: str, group: str = "") -> None:
    om, nm = old["metadata"], new.get("metadata") or {}
    causes: Causes = []
    for key in ("name", "namespace", "uid", "creationTimestamp"):
        if key == "creationTimestamp" and nm.get(key) and om.get(key) and _same_time(nm[key], om[key]):
            continue  # the same instant in another RFC 3339 form (a client's +00:00 for the server's Z)
        if nm.get(key) not in (None, om.get(key)):
            causes.append(
                (
                    f"metadata.{key}",
                    "FieldValueInvalid",
                    f'Invalid value: "{nm.get(key)}": field is immutable',
                )
            )
    if causes:
        raise invalid(kind, om["name"], causes, group)


# -- jobs ------------------------------------------------------------------------------------


def default_job(job: dict) -> None:
    """batch/v1's SetDefaults_Job: a Job that sets neither completions nor parallelism runs one pod to one
    completion; an Indexed Job without completions is left without, for validation to refuse."""
    spec = job.setdefault("spec", {})
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
        spec["parallelism"] = 1
    if spec.get("parallelism") is None:
        spec["parallelism"] = 1
    if spec.get("backoffLimit") is None:
        spec["backoffLimit"] = 2147483647 if spec.get("backoffLimitPerIndex") is not None else 6
    template = spec.get("template") if isinstance(spec.get("template"), dict) else {}
    template_labels = (template.get("metadata") or {}).get("labels")
    meta = job.setdefault("metadata", {})
    if template_labels and not meta.get("labels"):
        meta["labels"] = dict(template_labels)
    if spec.get("completionMode") is None:
        spec["completionMode"] = "NonIndexed"
    if spec.get("suspend") is None:
        spec["suspend"] = False
    if spec.get("podReplacementPolicy") is None:
        spec["podReplacementPolicy"] = (
            "Failed" if spec.get("podFailurePolicy") is not None else "TerminatingOrFailed"
        )
    if spec.get("manualSelector") is None:
        spec["manualSelector"] = False
    template = spec.setdefault("template", {})
    template.setdefault("metadata", {})
    default_pod_spec(template.setdefault("spec", {}))


def validate_job(job: dict) -> None:
    meta, spec = job.get("metadata", {}), job.get("spec") or {}
    causes: Causes = []
    check_metadata(causes, meta)
    name = meta.get("name", "")
    if name and len(name) > 63:
        bad(
            causes,
            "metadata.name",
            name,
            "must be no more than 63 characters (it becomes the job-name label)",
        )
    for field in (
        "parallelism",
        "completions",
        "backoffLimit",
        "activeDeadlineSeconds",
        "ttlSecondsAfterFinished",
    ):
        value = spec.get(field)
        if value is not None and (
            not isinstance(value, int) or value < (1 if field == "activeDeadlineSeconds" else 0)
        ):
            bad(causes, f"spec.{field}", value, "must be greater than or equal to 0")
    mode = spec.get("completionMode")
    if mode not in ("NonIndexed", "Indexed"):
        unsupported(causes, "spec.completionMode", mode, ("NonIndexed", "Indexed"))
    if mode == "Indexed" and not spec.get("completions"):
        req(causes, "spec.completions")
    for unsupported_field in (
        "podFailurePolicy",
        "successPolicy",
        "backoffLimitPerIndex",
        "maxFailedIndexes",
    ):
        if spec.get(unsupported_field) is not None:
            causes.append(
                (
                    f"spec.{unsupported_field}",
                    "FieldValueNotSupported",
                    "Unsupported value: not implemented by the local Kubernetes API",
                )
            )
    tspec = (spec.get("template") or {}).get("spec")
    if not isinstance(tspec, dict):
        req(causes, "spec.template.spec")
    else:
        policy = tspec.get("restartPolicy")
        if policy not in ("OnFailure", "Never"):
            unsupported(causes, "spec.template.spec.restartPolicy", policy, ("OnFailure", "Never"))
        validate_pod_spec(causes, tspec, "spec.template.spec")
        if tspec.get("ephemeralContainers"):
            causes.append(
                (
                    "spec.template.spec.ephemeralContainers",
                    "FieldValueForbidden",
                    "Forbidden: ephemeral containers not allowed in pod template",
                )
            )
    if causes:
        raise invalid("Job", name, causes, "batch")


MUTABLE_JOB_SPEC = (
    "parallelism",
    "suspend",
    "activeDeadlineSeconds",
    "ttlSecondsAfterFinished",
    "backoffLimit",
)


def validate_job_update(old: dict, new: dict) -> None:
    check_immutable_meta(old, new, "Job", "batch")
    os_, ns_ = dict(old.get("spec") or {}), dict(new.get("spec") or {})
    changed = sorted(k for k in set(os_) | set(ns_) if k not in MUTABLE_JOB_SPEC and os_.get(k) != ns_.get(k))
    if changed:
        field = f"spec.{changed[0]}"
        raise invalid(
            "Job",
            old["metadata"]["name"],
            [(field, "FieldValueInvalid", "Invalid value: field is immutable")],
            "batch",
        )


# -- secrets, configmaps, namespaces ---------------------------------------------------------


def validate_data_object(kind: str, obj: dict) -> None:
    import base64
    import binascii

    meta = obj.get("metadata", {})
    causes: Causes = []
    check_metadata(causes, meta)
    key_re = re.compile(r"^[-._a-zA-Z0-9]+$")
    for field in ("data", "binaryData", "stringData"):
        for key, value in (obj.get(field) or {}).items():
            if not key_re.match(key) or len(key) > 253:
                bad(
                    causes,
                    f"{field}[{key}]",
                    key,
                    "a valid config key must consist of alphanumeric characters, "
                    "'-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is "
                    "'[-._a-zA-Z0-9]+')",
                )
            if not isinstance(value, str):
                bad(causes, f"{field}[{key}]", value, "must be a string")
            elif (kind == "Secret" and field == "data") or field == "binaryData":
                try:
                    base64.b64decode(value, validate=True)
                except (binascii.Error, ValueError):
                    raise ApiError(
                        400,
                        "BadRequest",
                        f'{kind} in version "v1" cannot be handled as a {kind}: '
                        f"illegal base64 data in {field}[{key}]",
                    ) from None
    if causes:
        raise invalid(kind, meta.get("name", ""), causes)


def validate_namespace(obj: dict) -> None:
    causes: Causes = []
    check_metadata(causes, obj.get("metadata", {}), label_name=True)
    if causes:
        raise invalid("Namespace", obj.get("metadata", {}).get("name", ""), causes)


# -- services (headless only) ----------------------------------------------------------------

SERVICE_PROTOCOLS = ("TCP", "UDP", "SCTP")


def default_service(svc: dict) -> None:
    spec = svc.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec.get("clusterIP") in ("None",) and not spec.get("clusterIPs"):
        spec["clusterIPs"] = ["None"]
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    svc["status"] = svc.get("status") or {"loadBalancer": {}}


def validate_service(svc: dict) -> None:
    """The API server's Service checks, and the local server's one limit: headless Services only."""
    meta, spec = svc.get("metadata", {}), svc.get("spec") or {}
    causes: Causes = []
    check_metadata(causes, meta)
    name = meta.get("name") or ""
    if name and not DNS1035_LABEL.match(name):
        bad(
            causes,
            "metadata.name",
            name,
            "a DNS-1035 label must consist of lower case alphanumeric characters "
            "or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  "
            "or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')",
        )
    if spec.get("type") != "ClusterIP":
        unsupported(causes, "spec.type", spec.get("type"), ("ClusterIP",))
    if spec.get("clusterIP") != "None":
        causes.append(
            (
                "spec.clusterIP",
                "FieldValueNotSupported",
                f'Unsupported value: "{spec.get("clusterIP", "")}": '
                "the local Kubernetes API has no kube-proxy and serves headless Services only (clusterIP: None)",
            )
        )
    if spec.get("clusterIPs") not in (None, ["None"]):
        bad(causes, "spec.clusterIPs", spec.get("clusterIPs"), 'must be ["None"] for a headless Service')
    selector = spec.get("selector")
    if selector is not None and not isinstance(selector, dict):
        bad(causes, "spec.selector", selector, "must be a map of label keys to values")
    ports = spec.get("ports") or []
    names = set()
    for i, port in enumerate(ports):
        path = f"spec.ports[{i}]"
        if not isinstance(port, dict):
            bad(causes, path, port, "must be an object")
            continue
        if len(ports) > 1 and not port.get("name"):
            req(causes, f"{path}.name")
        if port.get("name"):
            if port["name"] in names:
                causes.append((f"{path}.name", "FieldValueDuplicate", f'Duplicate value: "{port["name"]}"'))
            names.add(port["name"])
        number = port.get("port")
        if not isinstance(number, int) or not 1 <= number <= 65535:
            bad(causes, f"{path}.port", number, "must be between 1 and 65535, inclusive")
        if port.get("protocol") not in SERVICE_PROTOCOLS:
            unsupported(causes, f"{path}.protocol", port.get("protocol"), SERVICE_PROTOCOLS)
        target = port.get("targetPort")
        if isinstance(target, int) and not 1 <= target <= 65535:
            bad(causes, f"{path}.targetPort", target, "must be between 1 and 65535, inclusive")
    if causes:
        raise invalid("Service", name, causes)


def validate_service_update(old: dict, new: dict) -> None:
    validate_service(new)
    if (old.get("spec") or {}).get("clusterIP") != (new.get("spec") or {}).get("clusterIP"):
        raise invalid(
            "Service",
            new["metadata"].get("name", ""),
            [("spec.clusterIP", "FieldValueInvalid", "Invalid value: field is immutable")],
        )
