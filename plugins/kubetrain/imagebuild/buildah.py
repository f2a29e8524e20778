"""Daemonless builds on the Airflow worker with Debian's buildah (VFS storage, chroot isolation).

Each builder has a private storage root, so builds of different workers (or tests) never
share or lock each other's image store. ``buildah bud`` builds with the layer cache on;
``buildah push`` sends the image to a staging tag, and the caller moves the requested tags
once the push is complete.
"""

from __future__ import annotations

import collections
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from kubetrain.imagebuild.builders import BuildError, BuildOutput, BuildRequest, PushTarget
from kubetrain.imagebuild.reference import check_digest

BUILDAH = "buildah"
TAIL_LINES = 25
STAGING_PREFIX = "kubetrain-staging-"


class BuildahBuilder:
    """Build with ``buildah bud`` and push with ``buildah push``.

    :param storage_root: the private image store (``--root``); the layer cache lives here.
    :param executable: the buildah binary.
    :param log: receives every output line of buildah as it comes.
    """

    name = "buildah"

    def __init__(
        self,
        storage_root: Path,
        *,
        executable: str = BUILDAH,
        log: Callable[[str], None] = print,
    ) -> None:
        self.storage_root = Path(storage_root)
        self.executable = shutil.which(executable) or executable
        self.log = log

    @property
    def _global_args(self) -> list[str]:
        return [
            self.executable,
            "--root", str(self.storage_root / "storage"),
            "--runroot", str(self.storage_root / "run"),
            "--storage-driver", "vfs",
        ]  # fmt: skip

    def _env(self, target: PushTarget) -> dict[str, str]:
        tmp = self.storage_root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        # A registries.conf of our own marks only the target registry as plain HTTP when asked,
        # instead of turning TLS verification off for every registry the build touches.
        conf = self.storage_root / "registries.conf"
        lines = ['unqualified-search-registries = ["docker.io"]']
        if target.insecure or not target.tls_verify:
            lines += ["", "[[registry]]", f'location = "{target.registry}"', "insecure = true"]
        conf.write_text("\n".join(lines) + "\n")
        return {
            **os.environ,
            "BUILDAH_ISOLATION": "chroot",
            "STORAGE_DRIVER": "vfs",
            "CONTAINERS_REGISTRIES_CONF": str(conf),
            "TMPDIR": str(tmp),
        }

    def _cert_args(self, target: PushTarget) -> list[str]:
        if not target.ca_bundle:
            return []
        certs = self.storage_root / "certs.d"
        certs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target.ca_bundle, certs / "ca.crt")
        return ["--cert-dir", str(certs)]

    def run(self, argv: Sequence[str], env: dict[str, str], what: str) -> list[str]:
        """Run buildah, streaming each output line to the log; raise :class:`BuildError` on failure."""
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        try:
            proc = subprocess.Popen(
                list(argv),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                text=True,
                errors="replace",
                bufsize=1,
            )
        except FileNotFoundError as exc:
            raise BuildError(f"{self.executable} is not installed: install Debian's buildah package") from exc
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                self.log(line)
        code = proc.wait()
        if code:
            last = "\n".join(tail)
            raise BuildError(f"{what} failed with exit code {code}; last lines:\n{last}", code, list(tail))
        return list(tail)

    def build_and_push(self, request: BuildRequest, target: PushTarget) -> BuildOutput:
        """Build ``request`` and push it to ``target`` under a fresh staging tag."""
        env = self._env(target)
        certs = self._cert_args(target)
        auth = ["--authfile", str(target.authfile)] if target.authfile else []
        local = f"localhost/{request.repository}:kubetrain-build"
        bud = [
            *self._global_args, "bud",
            "--isolation", "chroot",
            "--layers",
            "--format", request.image_format,
            "--file", str(request.dockerfile_path),
            "--tag", local,
            *auth, *certs,
        ]  # fmt: skip
        for name, value in request.build_args.items():
            bud += ["--build-arg", f"{name}={value}"]
        for name, value in request.labels.items():
            bud += ["--label", f"{name}={value}"]
        if request.target:
            bud += ["--target", request.target]
        if request.platform:
            bud += ["--platform", request.platform]
        bud.append(str(request.context))
        self.log(f"building {request.dockerfile_path} with buildah (storage {self.storage_root})")
        self.run(bud, env, "buildah bud")

        staging = STAGING_PREFIX + secrets.token_hex(6)
        digest_file = self.storage_root / "tmp" / f"{staging}.digest"
        push = [
            *self._global_args, "push",
            "--digestfile", str(digest_file),
            "--format", "oci" if request.image_format == "oci" else "v2s2",
            *auth, *certs,
            local, f"docker://{target.name}:{staging}",
        ]  # fmt: skip
        self.log(f"pushing to {target.name}:{staging} (staging tag)")
        self.run(push, env, "buildah push")
        try:
            digest = check_digest(digest_file.read_text().strip())
        finally:
            digest_file.unlink(missing_ok=True)
        return BuildOutput(digest, staging)
