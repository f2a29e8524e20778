"""A container's OCI runtime spec (``config.json`` of its bundle), as containerd's CRI plugin writes it for runc.

What comes from where, as on a node:

* the process: ENTRYPOINT/CMD of the image unless the container's ``command``/``args`` replace
  them; the image's ``Env`` under the container's; ``workingDir`` or the image's WORKDIR; the user
  from ``runAsUser``/``runAsGroup`` or the image's USER (a name is looked up in the image's own
  ``/etc/passwd`` and ``/etc/group``), its supplementary groups from the image's ``/etc/group``,
  ``supplementalGroups`` and ``fsGroup``; HOME from the image's passwd entry when the environment
  sets none;
* containerd's default capabilities, ``capabilities.add``/``drop``, ``privileged``,
  ``allowPrivilegeEscalation: false`` (no_new_privs), ``readOnlyRootFilesystem``;
* the image's root file system, the pod's volumes bind-mounted at their mount paths, the pod's
  ``/etc/hosts`` and ``/etc/hostname``; ``/proc``, ``/dev``, ``/dev/shm`` (64 MiB, as containerd's
  default), ``/sys`` read-only;
* PID, IPC, UTS and mount namespaces of its own; the host's network namespace (each pod binds its
  own loopback address instead, see podnet.py);
* a cgroup with the memory limit, CPU quota (limits) and shares (requests) of ``resources``.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from include.devstack.kubeapi.validation import parse_quantity

# containerd's default capabilities (pkg/oci/spec.go, populateDefaultUnixSpec)
DEFAULT_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)
# every capability the kernel knows, for privileged containers and "ALL"
ALL_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
)
MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
CFS_PERIOD = 100_000


class UserError(ValueError):
    """The container's user cannot be resolved in its image (CreateContainerError)."""


@dataclass(frozen=True)
class User:
    uid: int
    gid: int
    additional_gids: tuple[int, ...]
    home: str
    name: str | None


def _entries(rootfs: Path, name: str) -> list[list[str]]:
    """The lines of the image's ``/etc/<name>`` (a symlink is never followed out of the image)."""
    path = rootfs / "etc" / name
    if path.is_symlink() or not path.is_file():
        return []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def resolve_user(rootfs: Path, image_user: str, pod_sc: dict, sc: dict) -> User:
    """The process's user as containerd resolves it (WithUser, WithUserID, WithAdditionalGIDs)."""
    passwd = [e for e in _entries(rootfs, "passwd") if len(e) >= 7]
    groups = [e for e in _entries(rootfs, "group") if len(e) >= 4]
    run_as_user = sc.get("runAsUser", pod_sc.get("runAsUser"))
    run_as_group = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    entry = None
    gid: int | None = None
    if run_as_user is not None:
        uid = int(run_as_user)
        entry = next((e for e in passwd if e[2] == str(uid)), None)
    else:
        user, _, group = (image_user or "0").partition(":")
        if user.isdigit():
            uid = int(user)
            entry = next((e for e in passwd if e[2] == user), None)
        else:
            entry = next((e for e in passwd if e[0] == user), None)
            if entry is None:
                raise UserError(f"unable to find user {user}: no matching entries in passwd file")
            uid = int(entry[2])
        if group:
            if group.isdigit():
                gid = int(group)
            else:
                found = next((g for g in groups if g[0] == group), None)
                if found is None:
                    raise UserError(f"unable to find group {group}: no matching entries in group file")
                gid = int(found[2])
    if run_as_group is not None:
        gid = int(run_as_group)
    if gid is None:
        gid = int(entry[3]) if entry is not None and entry[3].isdigit() else 0
    name = entry[0] if entry is not None else None
    extra = [int(g[2]) for g in groups if name and name in g[3].split(",") and g[2].isdigit()]
    extra += [int(g) for g in pod_sc.get("supplementalGroups") or []]
    if pod_sc.get("fsGroup") is not None:
        extra.append(int(pod_sc["fsGroup"]))
    additional = tuple(dict.fromkeys(g for g in extra if g != gid))
    home = entry[5] if entry is not None and entry[5] else "/"
    return User(uid, gid, additional, home, name)


def capabilities(sc: dict) -> dict[str, list[str]]:
    if sc.get("privileged"):
        caps = list(ALL_CAPS)
    else:
        wanted = sc.get("capabilities") or {}
        drop = {_cap(c) for c in wanted.get("drop") or []}
        caps = [] if "CAP_ALL" in drop else [c for c in DEFAULT_CAPS if c not in drop]
        for c in wanted.get("add") or []:
            for cap in ALL_CAPS if _cap(c) == "CAP_ALL" else (_cap(c),):
                if cap not in caps:
                    caps.append(cap)
    return {"bounding": caps, "effective": caps, "permitted": caps}


def _cap(name: str) -> str:
    name = name.upper()
    return name if name.startswith("CAP_") else f"CAP_{name}"


def resources(container: dict) -> dict:
    res = container.get("resources") or {}
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    out: dict = {"devices": [{"allow": False, "access": "rwm"}]}
    if limits.get("memory") is not None:
        out["memory"] = {"limit": int(parse_quantity(limits["memory"]))}
    cpu: dict = {}
    if limits.get("cpu") is not None:
        cpu.update(quota=max(1000, int(parse_quantity(limits["cpu"]) * CFS_PERIOD)), period=CFS_PERIOD)
    request = requests.get("cpu", limits.get("cpu"))
    if request is not None:
        cpu["shares"] = max(2, int(parse_quantity(request) * 1024))
    if cpu:
        out["cpu"] = cpu
    return out


def nofile_limit() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1048576 if hard == resource.RLIM_INFINITY else min(hard, 1048576)


def runtime_spec(
    *,
    rootfs: Path,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    user: User,
    hostname: str,
    mounts: list[dict],
    container: dict,
    cgroups_path: str,
    hooks: dict | None = None,
) -> dict:
    """The ``config.json`` of one container's bundle.

    :param mounts: ``[{"src", "dst", "ro"}]``: volumes and the kubelet's files, bind-mounted in order.
    """
    sc = container.get("securityContext") or {}
    privileged = bool(sc.get("privileged"))
    no_new_privs = sc.get("allowPrivilegeEscalation") is False and not privileged
    nofile = nofile_limit()
    spec = {
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": False,
            "user": {
                "uid": user.uid,
                "gid": user.gid,
                **({"additionalGids": list(user.additional_gids)} if user.additional_gids else {}),
            },
            "args": argv,
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": cwd,
            "capabilities": capabilities(sc),
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": no_new_privs,
            "oomScoreAdj": 1000 if not (container.get("resources") or {}).get("requests") else 999,
        },
        "root": {"path": str(rootfs), "readonly": bool(sc.get("readOnlyRootFilesystem"))},
        "hostname": hostname,
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            {
                "destination": "/sys/fs/cgroup",
                "type": "cgroup",
                "source": "cgroup",
                "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
            },
        ],
        "linux": {
            "resources": resources(container),
            "cgroupsPath": cgroups_path,
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "maskedPaths": [] if privileged else list(MASKED_PATHS),
            "readonlyPaths": [] if privileged else list(READONLY_PATHS),
        },
    }
    for m in mounts:
        options = ["rbind", "rprivate", "ro" if m.get("ro") else "rw"]
        spec["mounts"].append(
            {"destination": m["dst"], "type": "bind", "source": m["src"], "options": options}
        )
    if hooks:
        spec["hooks"] = hooks
    return spec


def home_env(env: dict[str, str], user: User) -> None:
    """HOME from the image's passwd entry of the user, "/" without one, unless the environment sets it."""
    env.setdefault("HOME", user.home)


def non_root_problem(pod: dict, container: dict, image_user: str) -> str | None:
    """The kubelet's runAsNonRoot verification (verifyRunAsNonRoot); None when the container may start."""
    pod_sc = (pod.get("spec") or {}).get("securityContext") or {}
    sc = container.get("securityContext") or {}
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    if not non_root:
        return None
    meta = pod["metadata"]
    who = (
        f'(pod: "{meta["name"]}_{meta["namespace"]}({meta.get("uid", "")})", container: {container["name"]})'
    )
    run_as = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if run_as is not None:
        return f"container's runAsUser breaks non-root policy {who}" if int(run_as) == 0 else None
    user = image_user.split(":", 1)[0]
    if user == "":
        user = "0"
    if not user.isdigit():
        return f"container has runAsNonRoot and image has non-numeric user ({user}), cannot verify user is non-root {who}"
    if int(user) == 0:
        return f"container has runAsNonRoot and image will run as root {who}"
    return None
