"""Pod networking on one machine: an address of its own for each pod, and the names cluster DNS would give.

* Each pod gets a loopback address of its own, ``127.A.B.N`` (A.B from the server's port, so that
  two dev stacks on one machine do not hand out the same addresses), shown as ``status.podIP``.
  Containers keep the host's network namespace: the whole of 127.0.0.0/8 is local on Linux, so the
  pods reach each other, the host's services on 127.0.0.1 and the API server without any set-up.
* ``podbind.c``, preloaded into every container, binds a wildcard ``bind()`` (0.0.0.0, ::) to the
  pod's address, so that two pods listen on the same port as they do on a cluster.
* ``/etc/hosts`` of each container is a file of its pod, bind-mounted over the host's one: the
  kubelet's own entries plus, for every pod with ``hostname`` and ``subdomain`` that a headless
  Service of that name selects, ``<hostname>.<subdomain>.<namespace>.svc.cluster.local`` and its
  shorter forms, updated as such pods come and go (what cluster DNS answers on a real cluster).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from include.devstack.kubeapi.images import REPO

log = logging.getLogger("kubeapi.podnet")
SOURCE = Path(__file__).with_name("podbind.c")
CLUSTER_DOMAIN = "cluster.local"


def build_preload(fallback_dir: Path) -> Path | None:
    """Compile podbind.c (once per content) and return the shared object; None without a C compiler."""
    source = SOURCE.read_bytes()
    name = f"kubetrain-podbind-{hashlib.sha256(source).hexdigest()[:12]}.so"
    for directory in (REPO / ".tools" / "lib", fallback_dir):
        target = directory / name
        if target.exists():
            return target
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            log.warning("no C compiler: pods that bind 0.0.0.0 share the host's ports (install gcc)")
            return None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{name}.{os.getpid()}"
            subprocess.run(
                [compiler, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(SOURCE), "-ldl"],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(tmp, target)
            return target
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("cannot build %s in %s: %s %s", name, directory, exc, detail.decode(errors="replace"))
    return None


class Addresses:
    """Pod addresses 127.A.B.2-254 of one server, handed out round-robin and released with the sandbox."""

    def __init__(self, port: int) -> None:
        self.prefix = f"127.{(port >> 8) & 255}.{port & 255}"
        self.used: dict[str, str] = {}
        self.next = 2

    def allocate(self, uid: str) -> str:
        if uid in self.used:
            return self.used[uid]
        taken = set(self.used.values())
        for i in range(253):
            n = 2 + (self.next - 2 + i) % 253
            ip = f"{self.prefix}.{n}"
            if ip not in taken:
                self.next = n + 1
                self.used[uid] = ip
                return ip
        raise RuntimeError(f"no free pod address in {self.prefix}.0/24: 253 pods hold one")

    def release(self, uid: str) -> None:
        self.used.pop(uid, None)


def fqdn(hostname: str, subdomain: str, namespace: str) -> str:
    return f"{hostname}.{subdomain}.{namespace}.svc.{CLUSTER_DOMAIN}"


def hosts_file(pod: dict, pod_ip: str, records: list[tuple[str, str, str, str]]) -> str:
    """The pod's /etc/hosts: the kubelet's entries, host aliases, then the DNS records of headless Services."""
    meta, spec = pod["metadata"], pod["spec"]
    namespace = meta["namespace"]
    hostname = spec.get("hostname") or meta["name"][:63]
    lines = [
        "# Kubernetes-managed hosts file.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
    ]
    if spec.get("subdomain"):
        lines.append(f"{pod_ip}\t{fqdn(hostname, spec['subdomain'], namespace)}\t{hostname}")
    else:
        lines.append(f"{pod_ip}\t{hostname}")
    aliases = spec.get("hostAliases") or []
    if aliases:
        lines.append("")
        lines.append("# Entries added by HostAliases.")
        lines += [f"{a.get('ip')}\t{chr(9).join(a.get('hostnames') or [])}" for a in aliases]
    if records:
        lines.append("")
        lines.append(
            "# Pods of headless Services (the cluster DNS records), kept up to date by the local kubelet."
        )
        for ip, host, sub, ns in records:
            names = [fqdn(host, sub, ns), f"{host}.{sub}.{ns}.svc", f"{host}.{sub}.{ns}"]
            if ns == namespace:
                names.append(f"{host}.{sub}")
            lines.append(f"{ip}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


def dns_records(pods: list[dict], services: list[dict]) -> list[tuple[str, str, str, str]]:
    """(ip, hostname, subdomain, namespace) of each pod that a headless Service named like its subdomain selects.

    As the endpoints controller: the pod needs ``spec.hostname``, an address and a Service of the
    subdomain's name in its namespace whose selector matches its labels; it counts once it is Ready,
    or at once when the Service has ``publishNotReadyAddresses``.
    """
    by_name = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in services}
    out = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        svc = by_name.get((meta.get("namespace"), spec.get("subdomain")))
        ip = status.get("podIP")
        if (
            svc is None
            or not spec.get("hostname")
            or not ip
            or status.get("phase") in ("Succeeded", "Failed")
        ):
            continue
        if meta.get("deletionTimestamp"):
            continue
        selector = (svc.get("spec") or {}).get("selector") or {}
        labels = meta.get("labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            continue
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if not ready and not (svc.get("spec") or {}).get("publishNotReadyAddresses"):
            continue
        out.append((ip, spec["hostname"], spec["subdomain"], meta["namespace"]))
    return sorted(out, key=lambda r: (r[3], r[2], r[1]))


def write_in_place(path: Path, text: str) -> None:
    """Rewrite a bind-mounted file in place: replacing it would leave the containers on the old inode."""
    data = text.encode()
    with contextlib.suppress(FileNotFoundError):
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate(len(data))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
