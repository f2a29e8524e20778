"""Pod Security admission: the Pod Security Standards' baseline and restricted levels, as the built-in admission
plugin enforces them on the pods of a namespace labelled ``pod-security.kubernetes.io/enforce``.

A namespace's ``enforce`` level refuses a pod that breaks it, with the admission plugin's message
(``pods "x" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false
(container "c" must set securityContext.allowPrivilegeEscalation=false), ...``); its ``warn`` level
answers with the same text as a warning and admits the pod. The checks are those of
k8s.io/pod-security-admission's policy for the ``latest`` version (pods only: Jobs are not checked
themselves, their pods are, when the Job controller creates them).
"""

from __future__ import annotations

from collections.abc import Callable

LEVELS = ("privileged", "baseline", "restricted")
ENFORCE = "pod-security.kubernetes.io/enforce"
WARN = "pod-security.kubernetes.io/warn"
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
VOLUME_SOURCES = {
    "hostPath",
    "emptyDir",
    "gcePersistentDisk",
    "awsElasticBlockStore",
    "gitRepo",
    "secret",
    "nfs",
    "iscsi",
    "glusterfs",
    "persistentVolumeClaim",
    "rbd",
    "flexVolume",
    "cinder",
    "cephfs",
    "flocker",
    "downwardAPI",
    "fc",
    "azureFile",
    "configMap",
    "vsphereVolume",
    "quobyte",
    "azureDisk",
    "photonPersistentDisk",
    "projected",
    "portworxVolume",
    "scaleIO",
    "storageos",
    "csi",
    "ephemeral",
    "image",
}
APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"


def _containers(spec: dict) -> list[dict]:
    return [
        *(spec.get("initContainers") or []),
        *(spec.get("containers") or []),
        *(spec.get("ephemeralContainers") or []),
    ]


def _names(kind: str, names: list[str]) -> str:
    quoted = ", ".join(f'"{n}"' for n in names)
    return f"{kind}{'s' if len(names) > 1 else ''} {quoted}"


def _must(names: list[str], what: str, kind: str = "container") -> str:
    return f"{_names(kind, names)} must {what}"


Check = Callable[[dict, dict], "tuple[str, str] | None"]


def host_namespaces(meta: dict, spec: dict):
    used = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    return ("host namespaces", ", ".join(used)) if used else None


def privileged(meta: dict, spec: dict):
    bad = [c["name"] for c in _containers(spec) if (c.get("securityContext") or {}).get("privileged")]
    return ("privileged", _must(bad, "not set securityContext.privileged=true")) if bad else None


def capabilities_baseline(meta: dict, spec: dict):
    details = []
    for c in _containers(spec):
        added = [
            a
            for a in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
            if a not in BASELINE_CAPABILITIES
        ]
        if added:
            quoted = ", ".join(f'"{a}"' for a in added)
            details.append(
                f'container "{c["name"]}" must not include {quoted} in securityContext.capabilities.add'
            )
    return ("non-default capabilities", "; ".join(details)) if details else None


def host_path(meta: dict, spec: dict):
    bad = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    return ("hostPath volumes", _names("volume", bad)) if bad else None


def host_ports(meta: dict, spec: dict):
    details = []
    for c in _containers(spec):
        ports = [str(p["hostPort"]) for p in c.get("ports") or [] if p.get("hostPort")]
        if ports:
            details.append(
                f'container "{c["name"]}" uses hostPort{"s" if len(ports) > 1 else ""} {", ".join(ports)}'
            )
    return ("hostPort", "; ".join(details)) if details else None


def apparmor(meta: dict, spec: dict):
    bad = []
    annotations = meta.get("annotations") or {}
    for key, value in annotations.items():
        if (
            key.startswith(APPARMOR_PREFIX)
            and value not in ("runtime/default",)
            and not value.startswith("localhost/")
        ):
            bad.append(f'{key}="{value}"')
    profiles = [((spec.get("securityContext") or {}).get("appArmorProfile") or {}, "pod")]
    profiles += [
        ((c.get("securityContext") or {}).get("appArmorProfile") or {}, f'container "{c["name"]}"')
        for c in _containers(spec)
    ]
    for profile, who in profiles:
        if profile.get("type") == "Unconfined":
            bad.append(f'{who} must not set securityContext.appArmorProfile.type to "Unconfined"')
    return ("forbidden AppArmor profile" + ("s" if len(bad) > 1 else ""), ", ".join(bad)) if bad else None


def proc_mount(meta: dict, spec: dict):
    bad = [
        c["name"]
        for c in _containers(spec)
        if (c.get("securityContext") or {}).get("procMount") not in (None, "Default")
    ]
    return ("procMount", _must(bad, 'not set securityContext.procMount to "Unmasked"')) if bad else None


def seccomp_baseline(meta: dict, spec: dict):
    bad = []
    if ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type") == "Unconfined":
        bad.append("pod")
    bad += [
        c["name"]
        for c in _containers(spec)
        if ((c.get("securityContext") or {}).get("seccompProfile") or {}).get("type") == "Unconfined"
    ]
    if not bad:
        return None
    who = "pod" if bad == ["pod"] else _names("container", [b for b in bad if b != "pod"])
    if "pod" in bad and len(bad) > 1:
        who = "pod or " + who
    return ("seccompProfile", f'{who} must not set securityContext.seccompProfile.type to "Unconfined"')


def sysctls(meta: dict, spec: dict):
    bad = [
        s["name"]
        for s in (spec.get("securityContext") or {}).get("sysctls") or []
        if s.get("name") not in SAFE_SYSCTLS
    ]
    return ("forbidden sysctls", ", ".join(bad)) if bad else None


def host_process(meta: dict, spec: dict):
    options = [((spec.get("securityContext") or {}).get("windowsOptions") or {})]
    options += [((c.get("securityContext") or {}).get("windowsOptions") or {}) for c in _containers(spec)]
    return (
        ("hostProcess", "pod or containers must not set securityContext.windowsOptions.hostProcess=true")
        if any(o.get("hostProcess") for o in options)
        else None
    )


def volume_types(meta: dict, spec: dict):
    details = []
    for volume in spec.get("volumes") or []:
        kinds = [k for k in volume if k in VOLUME_SOURCES and k not in RESTRICTED_VOLUMES]
        if kinds:
            details.append(f'volume "{volume["name"]}" uses restricted volume type "{kinds[0]}"')
    return ("restricted volume types", ", ".join(details)) if details else None


def privilege_escalation(meta: dict, spec: dict):
    bad = [
        c["name"]
        for c in _containers(spec)
        if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False
    ]
    return (
        (
            "allowPrivilegeEscalation != false",
            _must(bad, "set securityContext.allowPrivilegeEscalation=false"),
        )
        if bad
        else None
    )


def run_as_non_root(meta: dict, spec: dict):
    pod_value = (spec.get("securityContext") or {}).get("runAsNonRoot")
    if pod_value is False:
        return ("runAsNonRoot != true", "pod must not set securityContext.runAsNonRoot=false")
    explicit_false = [
        c["name"] for c in _containers(spec) if (c.get("securityContext") or {}).get("runAsNonRoot") is False
    ]
    if explicit_false:
        return ("runAsNonRoot != true", _must(explicit_false, "not set securityContext.runAsNonRoot=false"))
    if pod_value is True:
        return None
    unset = [
        c["name"] for c in _containers(spec) if (c.get("securityContext") or {}).get("runAsNonRoot") is None
    ]
    if not unset:
        return None
    return ("runAsNonRoot != true", f"pod or {_must(unset, 'set securityContext.runAsNonRoot=true')}")


def run_as_user(meta: dict, spec: dict):
    bad = []
    if (spec.get("securityContext") or {}).get("runAsUser") == 0:
        bad.append("pod")
    bad += [c["name"] for c in _containers(spec) if (c.get("securityContext") or {}).get("runAsUser") == 0]
    if not bad:
        return None
    if bad == ["pod"]:
        return ("runAsUser=0", "pod must not set runAsUser=0")
    return ("runAsUser=0", _must([b for b in bad if b != "pod"], "not set runAsUser=0"))


def seccomp_restricted(meta: dict, spec: dict):
    allowed = ("RuntimeDefault", "Localhost")
    pod_type = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    bad_pod = pod_type is not None and pod_type not in allowed
    missing = []
    for c in _containers(spec):
        kind = ((c.get("securityContext") or {}).get("seccompProfile") or {}).get("type") or pod_type
        if kind not in allowed:
            missing.append(c["name"])
    if not missing and not bad_pod:
        return None
    who = ("pod or " + _names("container", missing)) if missing else "pod"
    return (
        "seccompProfile",
        f'{who} must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"',
    )


def capabilities_restricted(meta: dict, spec: dict):
    details = []
    no_drop = [
        c["name"]
        for c in _containers(spec)
        if "ALL" not in (((c.get("securityContext") or {}).get("capabilities") or {}).get("drop") or [])
    ]
    if no_drop:
        details.append(_must(no_drop, 'set securityContext.capabilities.drop=["ALL"]'))
    for c in _containers(spec):
        added = [
            a
            for a in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
            if a != "NET_BIND_SERVICE"
        ]
        if added:
            quoted = ", ".join(f'"{a}"' for a in added)
            details.append(
                f'container "{c["name"]}" must not include {quoted} in securityContext.capabilities.add'
            )
    return ("unrestricted capabilities", "; ".join(details)) if details else None


BASELINE: tuple[Check, ...] = (
    host_process,
    host_namespaces,
    privileged,
    capabilities_baseline,
    host_path,
    host_ports,
    apparmor,
    proc_mount,
    seccomp_baseline,
    sysctls,
)
RESTRICTED: tuple[Check, ...] = (
    *BASELINE,
    volume_types,
    privilege_escalation,
    run_as_non_root,
    run_as_user,
    seccomp_restricted,
    capabilities_restricted,
)


# the admission plugin's check IDs: its message lists the failed checks in the order of their IDs
CHECK_IDS = {
    host_process: "hostProcess",
    host_namespaces: "hostNamespaces",
    privileged: "privileged",
    capabilities_baseline: "capabilities_baseline",
    host_path: "hostPathVolumes",
    host_ports: "hostPorts",
    apparmor: "appArmorProfile",
    proc_mount: "procMount",
    seccomp_baseline: "seccompProfile_baseline",
    sysctls: "sysctls",
    volume_types: "restrictedVolumes",
    privilege_escalation: "allowPrivilegeEscalation",
    run_as_non_root: "runAsNonRoot",
    run_as_user: "runAsUser",
    seccomp_restricted: "seccompProfile_restricted",
    capabilities_restricted: "capabilities_restricted",
}


def violations(level: str, pod: dict) -> list[tuple[str, str]]:
    """(check, detail) for every check of ``level`` that ``pod`` fails; [] for privileged."""
    if level not in LEVELS:
        raise ValueError(f"unknown Pod Security level {level!r}: expected one of {', '.join(LEVELS)}")
    checks = {"privileged": (), "baseline": BASELINE, "restricted": RESTRICTED}[level]
    if level == "restricted":
        # baseline's capabilities and seccomp checks are subsumed by restricted's stricter ones
        checks = tuple(c for c in checks if c not in (capabilities_baseline, seccomp_baseline))
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    found = []
    for check in sorted(checks, key=CHECK_IDS.__getitem__):
        result = check(meta, spec)
        if result:
            found.append(result)
    return found


def summary(level: str, found: list[tuple[str, str]]) -> str:
    """``violates PodSecurity "restricted:latest": check (detail), ...``"""
    return f'violates PodSecurity "{level}:latest": ' + ", ".join(
        f"{name} ({detail})" for name, detail in found
    )


def levels(namespace: dict) -> tuple[str, str]:
    """The namespace's (enforce, warn) levels; an unknown label value counts as restricted, as the plugin treats it."""
    labels = (namespace.get("metadata") or {}).get("labels") or {}

    def level(key: str) -> str:
        value = labels.get(key, "privileged")
        return value if value in LEVELS else "restricted"

    return level(ENFORCE), level(WARN)
