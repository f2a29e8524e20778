"""Real registries and images for the image build tests (Debian's docker-registry, skopeo).

* :class:`LocalRegistry`: a docker-registry on a free loopback port, optionally behind
  htpasswd auth, whose request log can be read back (an independent count of what
  reached the registry);
* :func:`push_busybox_base`: a tiny base image (Debian's static busybox in a scratch image);
* :func:`skopeo_pull`: copy an image with skopeo to an OCI layout and read it back.
"""

from __future__ import annotations

import gzip
import io
import json
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
for _path in (REPO, REPO / "plugins"):  # Airflow adds plugins/ itself; plain pytest may not
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from include.devstack import registry as devstack_registry  # noqa: E402
from include.devstack.stack import free_port, wait_http  # noqa: E402
from kubetrain.imagebuild.layer import write_layer  # noqa: E402
from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, RegistryClient, push_image  # noqa: E402

BUSYBOX = Path("/bin/busybox")
BUSYBOX_APPLETS = ("sh", "ls", "cat", "echo", "mkdir", "env", "test", "true", "grep")
_ACCESS_LINE = re.compile(r'"(GET|HEAD|POST|PUT|PATCH|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash as htpasswd files hold it (the registry accepts only bcrypt)."""
    try:
        import bcrypt

        return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()
    except ImportError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # glibc's libxcrypt does bcrypt; the module is in Python 3.11's stdlib

        return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 5))


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    status: int


@dataclass
class LocalRegistry:
    """A running docker-registry; ``requests(mark)`` lists what reached it after ``mark()``."""

    root: Path
    port: int
    proc: subprocess.Popen
    log: Path
    users: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, username: str | None = None, password: str | None = None) -> RegistryClient:
        return RegistryClient(self.host, insecure=True, username=username, password=password, timeout=30)

    def mark(self) -> int:
        return self.log.stat().st_size

    def requests(self, since: int = 0) -> list[Request]:
        with self.log.open("rb") as fh:
            fh.seek(since)
            text = fh.read().decode(errors="replace")
        return [Request(m, p, int(s)) for m, p, s in _ACCESS_LINE.findall(text)]

    def conn_env(
        self, conn_id: str, username: str | None = None, password: str | None = None
    ) -> dict[str, str]:
        """``AIRFLOW_CONN_<ID>`` in JSON form for this registry."""
        conn = {
            "conn_type": "kubetrain_registry",
            "host": "127.0.0.1",
            "port": self.port,
            "extra": {"insecure": True},
        }
        if username:
            conn.update(login=username, password=password or "")
        return {f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(conn)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_registry(root: Path, users: dict[str, str] | None = None) -> LocalRegistry:
    """Start Debian's docker-registry under ``root`` (with htpasswd auth when ``users`` is given)."""
    root.mkdir(parents=True, exist_ok=True)
    htpasswd = None
    if users:
        htpasswd = root / "htpasswd"
        htpasswd.write_text("".join(f"{u}:{bcrypt_hash(p)}\n" for u, p in users.items()))
    port = free_port()
    argv = devstack_registry.command(root, port, htpasswd=htpasswd)
    log = root / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/v2/", 30, proc, log)
    return LocalRegistry(root, port, proc, log, dict(users or {}))


def go_arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def busybox_rootfs(dest: Path) -> Path:
    """A root filesystem holding only the static busybox and a few applet links."""
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, dest / "bin" / "busybox")
    for applet in BUSYBOX_APPLETS:
        (dest / "bin" / applet).symlink_to("busybox")
    (dest / "tmp").mkdir(exist_ok=True)
    return dest


def push_busybox_base(
    client: RegistryClient, repository: str, tag: str, work: Path, extra_layers: list | None = None
) -> str:
    """Push a busybox scratch image (plus ``extra_layers``, :class:`Blob` s) and return its digest."""
    rootfs = busybox_rootfs(work / "rootfs")
    layer = write_layer(rootfs, work / "busybox.tar.gz", excludes=())
    config = {
        "architecture": go_arch(),
        "os": "linux",
        "created": "2026-01-01T00:00:00Z",
        "config": {
            "Env": ["PATH=/bin", "BASE_ONLY=1"],
            "Cmd": ["/bin/sh"],
            "Labels": {"base.label": "busybox"},
        },
        "history": [{"created": "2026-01-01T00:00:00Z", "created_by": "busybox-static"}],
    }
    layers = [layer.blob(OCI_LAYER_GZIP), *(extra_layers or [])]
    config["history"] += [
        {"created": "2026-01-01T00:00:00Z", "created_by": "extra"} for _ in extra_layers or []
    ]
    return push_image(client, repository, tag, layers, config)


@dataclass
class PulledImage:
    """An image as an independent client (skopeo) fetched it."""

    manifest: dict
    config: dict
    layers: list[dict[str, tuple[tarfile.TarInfo, bytes]]]

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.config.get("config", {}).get("Env") or [])

    @property
    def labels(self) -> dict[str, str]:
        return self.config.get("config", {}).get("Labels") or {}

    def filesystem(self) -> dict[str, bytes | str]:
        """The merged filesystem: path -> file bytes, or 'dir' / 'link:<target>'; whiteouts applied."""
        fs: dict[str, bytes | str] = {}
        for layer in self.layers:
            for name, (info, data) in layer.items():
                parent, _, base = name.rpartition("/")
                if base == ".wh..wh..opq":
                    prefix = parent + "/"
                    for path in [p for p in fs if p.startswith(prefix) and p not in layer]:
                        del fs[path]
                    continue
                if base.startswith(".wh."):
                    target = f"{parent}/{base[4:]}" if parent else base[4:]
                    for path in [p for p in fs if p == target or p.startswith(target + "/")]:
                        del fs[path]
                    continue
                if info.isdir():
                    fs[name] = "dir"
                elif info.issym():
                    fs[name] = f"link:{info.linkname}"
                else:
                    fs[name] = data
        return fs


def skopeo_raw_manifest(reference: str) -> dict:
    """The manifest exactly as the registry serves it (``skopeo inspect --raw``)."""
    argv = ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{reference}"]
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout)


def skopeo_pull(reference: str, dest: Path, creds: str | None = None) -> PulledImage:
    """``skopeo copy docker://reference oci:dest`` and read manifest, config and layer entries."""
    argv = ["skopeo", "copy", "--quiet", "--src-tls-verify=false"]
    if creds:
        argv += ["--src-creds", creds]
    argv += [f"docker://{reference}", f"oci:{dest}:pulled"]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120)
    index = json.loads((dest / "index.json").read_text())
    blobs = dest / "blobs" / "sha256"

    def blob(digest: str) -> bytes:
        return (blobs / digest.removeprefix("sha256:")).read_bytes()

    manifest = json.loads(blob(index["manifests"][0]["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    layers = []
    for desc in manifest["layers"]:
        raw = blob(desc["digest"])
        if desc["mediaType"].endswith("gzip"):
            raw = gzip.decompress(raw)
        entries = {}
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for info in tar.getmembers():
                data = tar.extractfile(info).read() if info.isfile() else b""
                entries[info.name.rstrip("/").removeprefix("./")] = (info, data)
        layers.append(entries)
    return PulledImage(manifest, config, layers)


def tags(registry: LocalRegistry, repository: str) -> list[str]:
    """The repository's tags as skopeo sees them (empty when the repository does not exist)."""
    argv = ["skopeo", "list-tags", "--tls-verify=false"]
    if registry.users:
        argv += ["--creds", ":".join(next(iter(registry.users.items())))]
    out = subprocess.run(
        [*argv, f"docker://{registry.host}/{repository}"], capture_output=True, text=True, timeout=60
    )
    if out.returncode:
        if "NAME_UNKNOWN" in out.stderr or "404" in out.stderr or "name unknown" in out.stderr.lower():
            return []
        raise RuntimeError(f"skopeo list-tags failed: {out.stderr}")
    return json.loads(out.stdout)["Tags"] or []


class TokenService:
    """A Bearer token service for a docker-registry with ``auth: token`` (the Docker Hub / GHCR scheme).

    It checks Basic credentials, grants the scopes asked for, and signs JWTs with a
    self-signed certificate that the registry trusts (``rootcertbundle``).
    """

    def __init__(self, root: Path, users: dict[str, str], service: str = "kubetrain-test") -> None:
        import base64 as b64
        import datetime as dt
        import http.server
        import secrets
        import threading
        import urllib.parse

        import jwt
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.service, self.issuer, self.users, self.issued = service, "kubetrain-test-issuer", users, []
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubetrain test token signer")])
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        root.mkdir(parents=True, exist_ok=True)
        self.cert_path = root / "token-signer.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        x5c = [b64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()]
        service_ref = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                header = self.headers.get("Authorization", "")
                user = None
                if header.startswith("Basic "):
                    u, _, p = b64.b64decode(header[6:]).decode().partition(":")
                    if service_ref.users.get(u) != p:
                        self.send_response(401)
                        self.send_header("Content-Type", "application/json")
                        self.end_headers()
                        self.wfile.write(b'{"details": "invalid username or password"}')
                        return
                    user = u
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                access = []
                for scope in query.get("scope", []):
                    kind, _, rest = scope.partition(":")
                    repo, _, actions = rest.rpartition(":")
                    allowed = actions.split(",") if user else [a for a in actions.split(",") if a == "pull"]
                    access.append({"type": kind, "name": repo, "actions": allowed})
                issued = int(time.time())
                claims = {
                    "iss": service_ref.issuer,
                    "sub": user or "",
                    "aud": query.get("service", [""])[0],
                    "exp": issued + 300,
                    "nbf": issued - 10,
                    "iat": issued,
                    "jti": secrets.token_hex(8),
                    "access": access,
                }
                token = jwt.encode(claims, key, algorithm="RS256", headers={"x5c": x5c})
                service_ref.issued.append(claims)
                body = json.dumps({"token": token, "access_token": token, "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


def start_token_registry(root: Path, users: dict[str, str]) -> tuple[LocalRegistry, TokenService]:
    """A docker-registry that accepts only Bearer tokens from a :class:`TokenService`."""
    tokens = TokenService(root, users)
    port = free_port()
    argv = devstack_registry.command(root, port)  # writes the base config; auth is added below
    config = json.loads((root / "config.yml").read_text())
    config["auth"] = {
        "token": {
            "realm": tokens.realm,
            "service": tokens.service,
            "issuer": tokens.issuer,
            "rootcertbundle": str(tokens.cert_path),
        }
    }
    (root / "config.yml").write_text(json.dumps(config, indent=2))
    log = root / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/v2/", 30, proc, log)
    return LocalRegistry(root, port, proc, log, dict(users)), tokens
