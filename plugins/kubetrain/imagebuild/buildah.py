"""Daemonless builds on the Airflow worker with Debian's buildah (chroot isolation).

Each builder has a private storage root, so builds of different workers (or tests) never
share or lock each other's image store. ``buildah bud`` builds with the layer cache on;
``buildah push`` sends the image to a staging tag, and the caller moves the requested tags
once the push is complete.

The storage driver is ``vfs`` unless asked otherwise: it works everywhere, also in an
unprivileged container, but copies the whole file tree for every step. ``overlay`` shares
layers and is many times faster for large images; :func:`detect_storage_driver` picks it
where the kernel lets this process mount overlays. The two drivers keep separate stores.

Besides building, a builder can run a command inside a built image (``buildah run``, for
checks before an image is pushed), turn a root file system tarball into a base image, and
export an image to an OCI layout so that later pushes copy its compressed blobs instead of
compressing them again (:meth:`BuildahBuilder.push_layout`, with skopeo).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kubetrain.imagebuild.builders import BuildError, BuildOutput, BuildRequest, PushTarget
from kubetrain.imagebuild.reference import check_digest

BUILDAH = "buildah"
SKOPEO = "skopeo"
TAIL_LINES = 25
STAGING_PREFIX = "kubetrain-staging-"
STORAGE_DRIVERS = ("vfs", "overlay")


def detect_storage_driver(storage_root: Path, executable: str = BUILDAH) -> str:
    """``overlay`` when this process can mount an overlay store under ``storage_root``, else ``vfs``.

    The answer is remembered in ``storage_root/driver`` so that the probe runs once per root.
    """
    storage_root = Path(storage_root)
    remembered = storage_root / "driver"
    if remembered.exists() and remembered.read_text().strip() in STORAGE_DRIVERS:
        return remembered.read_text().strip()
    storage_root.mkdir(parents=True, exist_ok=True)
    probe = Path(tempfile.mkdtemp(prefix="overlay-probe-", dir=storage_root))
    base = [
        shutil.which(executable) or executable,
        "--root",
        str(probe / "storage"),
        "--runroot",
        str(probe / "run"),
        "--storage-driver",
        "overlay",
    ]
    driver = "vfs"
    try:
        made = subprocess.run([*base, "from", "scratch"], capture_output=True, text=True, timeout=60)
        if made.returncode == 0:
            container = made.stdout.strip().splitlines()[-1]
            mounted = subprocess.run([*base, "mount", container], capture_output=True, text=True, timeout=60)
            if mounted.returncode == 0:
                driver = "overlay"
            subprocess.run([*base, "rm", container], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass
    finally:
        subprocess.run([*base, "rm", "--all"], capture_output=True, timeout=60)
        shutil.rmtree(probe, ignore_errors=True)
    remembered.write_text(driver + "\n")
    return driver


class BuildahBuilder:
    """Build with ``buildah bud`` and push with ``buildah push`` (or skopeo from an OCI layout).

    :param storage_root: the private image store (``--root``); the layer cache lives here.
    :param executable: the buildah binary.
    :param log: receives every output line of buildah as it comes.
    :param storage_driver: ``vfs`` (default, works everywhere), ``overlay``, or ``auto``
        (:func:`detect_storage_driver`).
    :param mirror: ``host[:port]`` of a registry mirror for docker.io images (FROM lines), tried first.
    :param mirror_insecure: speak plain HTTP to the mirror.
    """

    name = "buildah"

    def __init__(
        self,
        storage_root: Path,
        *,
        executable: str = BUILDAH,
        log: Callable[[str], None] = print,
        storage_driver: str = "vfs",
        mirror: str | None = None,
        mirror_insecure: bool = False,
    ) -> None:
        # absolute: buildah runs steps from other working directories, and TMPDIR must still resolve
        self.storage_root = Path(storage_root).resolve()
        self.mirror, self.mirror_insecure = mirror, mirror_insecure
        self.executable = shutil.which(executable) or executable
        self.log = log
        if storage_driver == "auto":
            storage_driver = detect_storage_driver(self.storage_root, executable)
        if storage_driver not in STORAGE_DRIVERS:
            raise ValueError(f"invalid storage driver {storage_driver!r}: expected one of vfs, overlay, auto")
        self.storage_driver = storage_driver

    @property
    def _global_args(self) -> list[str]:
        # vfs keeps the historical path, so existing layer caches stay valid
        store = "storage" if self.storage_driver == "vfs" else f"storage-{self.storage_driver}"
        return [
            self.executable,
            "--root",
            str(self.storage_root / store),
            "--runroot",
            str(self.storage_root / f"run-{self.storage_driver}"),
            "--storage-driver",
            self.storage_driver,
        ]

    def _env(self, target: PushTarget | None = None) -> dict[str, str]:
        tmp = self.storage_root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        # A registries.conf of our own marks only the target registry as plain HTTP when asked,
        # instead of turning TLS verification off for every registry the build touches.
        lines = ['unqualified-search-registries = ["docker.io"]']
        if self.mirror:
            lines += [
                "",
                "[[registry]]",
                'prefix = "docker.io"',
                'location = "docker.io"',
                "[[registry.mirror]]",
                f'location = "{self.mirror}"',
            ] + (["insecure = true"] if self.mirror_insecure else [])
        if target is not None and (target.insecure or not target.tls_verify):
            lines += ["", "[[registry]]", f'location = "{target.registry}"', "insecure = true"]
        text = "\n".join(lines) + "\n"
        conf = self.storage_root / f"registries-{hashlib.sha256(text.encode()).hexdigest()[:12]}.conf"
        if not conf.exists():
            conf.write_text(text)
        return {
            **os.environ,
            "BUILDAH_ISOLATION": "chroot",
            "STORAGE_DRIVER": self.storage_driver,
            "CONTAINERS_REGISTRIES_CONF": str(conf),
            "TMPDIR": str(tmp),
        }

    def _cert_args(self, target: PushTarget, flag: str = "--cert-dir") -> list[str]:
        if not target.ca_bundle:
            return []
        certs = self.storage_root / "certs.d"
        certs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target.ca_bundle, certs / "ca.crt")
        return [flag, str(certs)]

    def run(self, argv: Sequence[str], env: dict[str, str], what: str, *, quiet: bool = False) -> list[str]:
        """Run buildah, streaming each output line to the log; raise :class:`BuildError` on failure.

        :param quiet: keep the output out of the log; a failure still carries its last lines.
        """
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
            tool = Path(argv[0]).name
            raise BuildError(f"{tool} is not installed: install Debian's {tool} package") from exc
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                if not quiet:
                    self.log(line)
        code = proc.wait()
        if code:
            last = "\n".join(tail)
            raise BuildError(f"{what} failed with exit code {code}; last lines:\n{last}", code, list(tail))
        return list(tail)

    def _quiet(self, args: Sequence[str], what: str, env: dict[str, str] | None = None) -> str:
        """Run a buildah subcommand whose output is a value (an id, JSON), not a log."""
        proc = subprocess.run(
            [*self._global_args, *args],
            capture_output=True,
            text=True,
            env=env or self._env(),
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode:
            raise BuildError(
                f"{what} failed with exit code {proc.returncode}: {proc.stderr.strip()[-2000:]}",
                proc.returncode,
                proc.stderr.splitlines()[-TAIL_LINES:],
            )
        return proc.stdout.strip()

    # -- building ----------------------------------------------------------------------------

    def build(
        self,
        request: BuildRequest,
        target: PushTarget | None = None,
        *,
        local_tag: str = "kubetrain-build",
        local_name: str | None = None,
    ) -> str:
        """Build ``request`` into the local store; returns the local image name.

        :param target: where the image will go (its registry settings also apply to FROM pulls).
        :param local_tag: the tag of the local image, ``localhost/<repository>:<local_tag>``.
        :param local_name: the whole local name instead.
        """
        env = self._env(target)
        extra: list[str] = []
        if target is not None:
            extra += ["--authfile", str(target.authfile)] if target.authfile else []
            extra += self._cert_args(target)
        local = local_name or f"localhost/{request.repository}:{local_tag}"
        bud = [
            *self._global_args,
            "bud",
            "--isolation",
            "chroot",
            "--layers",
            "--format",
            request.image_format,
            "--file",
            str(request.dockerfile_path),
            "--tag",
            local,
            *extra,
        ]
        for name, value in request.build_args.items():
            bud += ["--build-arg", f"{name}={value}"]
        for name, value in request.labels.items():
            bud += ["--label", f"{name}={value}"]
        if request.target:
            bud += ["--target", request.target]
        if request.platform:
            bud += ["--platform", request.platform]
        bud.append(str(request.context))
        self.log(
            f"building {request.dockerfile_path} with buildah (storage {self.storage_root}, {self.storage_driver})"
        )
        self.run(bud, env, "buildah bud")
        return local

    def push(self, local: str, target: PushTarget, tag: str, *, image_format: str = "oci") -> str:
        """Push the local image ``local`` to ``target`` as ``tag``; returns the pushed manifest's digest."""
        env = self._env(target)
        auth = ["--authfile", str(target.authfile)] if target.authfile else []
        digest_file = self.storage_root / "tmp" / f"push-{secrets.token_hex(6)}.digest"
        push = [
            *self._global_args,
            "push",
            "--digestfile",
            str(digest_file),
            "--format",
            "oci" if image_format == "oci" else "v2s2",
            *auth,
            *self._cert_args(target),
            local,
            f"docker://{target.name}:{tag}",
        ]
        self.log(f"pushing to {target.name}:{tag}")
        self.run(push, env, "buildah push")
        try:
            return check_digest(digest_file.read_text().strip())
        finally:
            digest_file.unlink(missing_ok=True)

    def build_and_push(self, request: BuildRequest, target: PushTarget) -> BuildOutput:
        """Build ``request`` and push it to ``target`` under a fresh staging tag."""
        local = self.build(request, target)
        staging = STAGING_PREFIX + secrets.token_hex(6)
        self.log(f"(staging tag {staging})")
        return BuildOutput(self.push(local, target, staging, image_format=request.image_format), staging)

    # -- local images ------------------------------------------------------------------------

    def image_id(self, name: str) -> str | None:
        """The id of local image ``name``, or None when the store has no such image."""
        proc = subprocess.run(
            [*self._global_args, "inspect", "--type", "image", "--format", "{{.FromImageID}}", name],
            capture_output=True,
            text=True,
            env=self._env(),
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode:
            return None
        return proc.stdout.strip() or None

    def image_config(self, name: str) -> dict:
        """The OCI image configuration of local image ``name`` (``config.User``, ``config.Env``, ...)."""
        raw = self._quiet(["inspect", "--type", "image", name], f"buildah inspect {name}")
        return json.loads(raw).get("OCIv1", {})

    def import_rootfs(
        self,
        tarball: Path,
        name: str,
        *,
        env: Mapping[str, str] | None = None,
        cmd: Sequence[str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> str:
        """Make local image ``name`` from a root file system tarball (``FROM scratch`` plus the tree)."""
        if not Path(tarball).is_file():
            raise ValueError(
                f"root file system {str(tarball)!r} does not exist: expected a tar of a whole tree"
            )
        container = self._quiet(["from", "--quiet", "scratch"], "buildah from scratch").splitlines()[-1]
        try:
            mountpoint = self._quiet(["mount", container], "buildah mount")
            self.log(f"unpacking {tarball} into {name}")
            self.run(["tar", "--numeric-owner", "-xpf", str(tarball), "-C", mountpoint], self._env(), "tar")
            config: list[str] = []
            for key, value in (env or {}).items():
                config += ["--env", f"{key}={value}"]
            for key, value in (labels or {}).items():
                config += ["--label", f"{key}={value}"]
            if cmd:
                config += ["--cmd", json.dumps(list(cmd))]
            if config:
                self._quiet(["config", *config, container], "buildah config")
            self._quiet(["commit", "--quiet", "--format", "oci", container, name], "buildah commit")
        finally:
            subprocess.run([*self._global_args, "rm", container], capture_output=True, env=self._env())
        return name

    def run_in_image(
        self,
        image: str,
        command: Sequence[str],
        *,
        volumes: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        what: str | None = None,
        quiet: bool = False,
    ) -> list[str]:
        """Run ``command`` in a throw-away container of local image ``image``; returns its last lines.

        The image's user, working directory and environment apply as in a pod.

        :param volumes: host directory -> path in the container (``:ro`` may end the path).
        :param quiet: keep the command's output out of the log (it is in the error if the command fails).
        :raises BuildError: when the command fails, with its last output lines.
        """
        container = self._quiet(
            ["from", "--quiet", "--pull-never", image], f"buildah from {image}"
        ).splitlines()[-1]
        try:
            argv = [*self._global_args, "run", "--isolation", "chroot"]
            for host, path in (volumes or {}).items():
                argv += ["--volume", f"{host}:{path}"]
            for key, value in (env or {}).items():
                argv += ["--env", f"{key}={value}"]
            if user:
                argv += ["--user", user]
            argv += [container, "--", *command]
            return self.run(argv, self._env(), what or f"{' '.join(command)} in {image}", quiet=quiet)
        finally:
            subprocess.run([*self._global_args, "rm", container], capture_output=True, env=self._env())

    # -- OCI layouts -------------------------------------------------------------------------

    def export_layout(self, local: str, layout: Path, ref: str) -> None:
        """Write local image ``local`` into the OCI layout ``layout`` as ``ref`` (layers compressed once)."""
        layout.mkdir(parents=True, exist_ok=True)
        self.run(
            [*self._global_args, "push", "--format", "oci", local, f"oci:{layout}:{ref}"],
            self._env(),
            "buildah push to an OCI layout",
        )

    def push_layout(
        self, layout: Path, ref: str, target: PushTarget, tag: str, *, skopeo: str = SKOPEO
    ) -> str:
        """Copy image ``ref`` of an OCI layout to ``target`` as ``tag`` with skopeo; returns its digest.

        The layout's compressed blobs go over the wire as they are, so pushing a large image
        again (to a new registry) costs no compression.
        """
        env = self._env(target)
        digest_file = self.storage_root / "tmp" / f"copy-{secrets.token_hex(6)}.digest"
        argv = [shutil.which(skopeo) or skopeo, "copy", "--quiet", "--digestfile", str(digest_file)]
        if target.authfile:
            argv += ["--dest-authfile", str(target.authfile)]
        if target.insecure or not target.tls_verify:
            argv += ["--dest-tls-verify=false"]
        argv += self._cert_args(target, "--dest-cert-dir")
        argv += [f"oci:{layout}:{ref}", f"docker://{target.name}:{tag}"]
        self.log(f"pushing {ref} to {target.name}:{tag}")
        self.run(argv, env, "skopeo copy")
        try:
            return check_digest(digest_file.read_text().strip())
        finally:
            digest_file.unlink(missing_ok=True)
