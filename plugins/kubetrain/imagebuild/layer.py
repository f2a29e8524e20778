"""Deterministic layer tarballs: the same source tree always gives the same bytes and digest.

Entries are sorted, owned by 0:0 with empty user and group names, dated at the epoch,
with modes reduced to 0755 (directories and executables) or 0644; the gzip stream has
mtime 0 and no file name. Archives are written in one pass through hashing writers,
so the uncompressed digest (the layer's ``diff_id``) and the blob digest come for free.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Protocol, cast

from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, Blob

# What never belongs in a code layer or a build context: environments, caches, tests.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".venv",
    "__pycache__",
    "*.pyc",
    "tests",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
    ".git",
    # the multi-buffer MD5 that `make setup` compiles into a checkout's trainer/sync: the sync
    # image compiles its own (trainer/Dockerfile.sync), as trainer/.dockerignore says
    "_md5many.so",
)
OPAQUE_WHITEOUT = ".wh..wh..opq"
GZIP_LEVEL = 6


def _excluded(rel: PurePosixPath, excludes: Sequence[str]) -> bool:
    for pattern in excludes:
        if "/" in pattern:
            if fnmatch.fnmatchcase(rel.as_posix(), pattern):
                return True
        elif any(fnmatch.fnmatchcase(part, pattern) for part in rel.parts):
            return True
    return False


def select_files(src: Path, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> list[PurePosixPath]:
    """Relative paths under ``src`` (directories, files, symlinks) that go into the layer, sorted.

    A pattern without '/' matches any path component (``tests`` drops every tests/ directory);
    one with '/' matches the whole relative path.

    :raises ValueError: when ``src`` is not a directory.
    """
    if not src.is_dir():
        raise ValueError(f"source directory {str(src)!r} does not exist or is not a directory")
    selected: list[PurePosixPath] = []
    for root, dirs, files in os.walk(src, followlinks=False):
        base = PurePosixPath(Path(root).relative_to(src).as_posix())
        keep_dirs = []
        for name in dirs:
            rel = base / name if base.parts else PurePosixPath(name)
            if _excluded(rel, excludes):
                continue
            selected.append(rel)
            if not (Path(root) / name).is_symlink():
                keep_dirs.append(name)
        dirs[:] = keep_dirs
        for name in files:
            rel = base / name if base.parts else PurePosixPath(name)
            if not _excluded(rel, excludes):
                selected.append(rel)
    return sorted(selected, key=lambda p: p.parts)


def tree_hash(src: Path, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> str:
    """sha256 over the selected paths, their kind, executable bit and content: the code's identity."""
    digest = hashlib.sha256()
    for rel in select_files(src, excludes):
        path = src / rel
        if path.is_symlink():
            record = f"L\t{rel}\t{os.readlink(path)}"
        elif path.is_dir():
            record = f"D\t{rel}"
        else:
            record = f"F\t{rel}\t{_mode(path.lstat().st_mode):o}\t{_file_sha256(path)}"
        digest.update(record.encode() + b"\n")
    return digest.hexdigest()


def files_hash(paths: Iterable[Path]) -> str:
    """sha256 over the names and contents of ``paths`` (missing files count as absent)."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        if path.is_file():
            digest.update(f"{path.name}\t{_file_sha256(path)}\n".encode())
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _mode(st_mode: int) -> int:
    if stat.S_ISDIR(st_mode) or st_mode & 0o111:
        return 0o755
    return 0o644


class _Sink(Protocol):
    """What :class:`_HashingWriter` passes bytes on to: a binary file, or a ``GzipFile`` writing into one."""

    def write(self, data: bytes, /) -> object: ...

    def flush(self) -> object: ...


class _HashingWriter:
    """A write-only file that hashes and counts what passes through to ``target``."""

    def __init__(self, target: _Sink | None) -> None:
        self.target = target
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.target is not None:
            self.target.write(data)
        return len(data)

    def flush(self) -> None:
        if self.target is not None:
            self.target.flush()


def _tarinfo(name: str, kind: bytes, mode: int, size: int = 0, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.linkname = linkname
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


@dataclass(frozen=True)
class LayerFile:
    """A layer written to disk: ``digest``/``size`` of the gzip blob, ``diff_id`` of the tar inside."""

    path: Path
    digest: str
    size: int
    diff_id: str
    entries: int

    def blob(self, media_type: str = OCI_LAYER_GZIP) -> Blob:
        return Blob(self.digest, self.size, media_type, self.path, self.diff_id)


def write_layer(
    src: Path,
    out: Path,
    *,
    dest: str = "",
    excludes: Sequence[str] = DEFAULT_EXCLUDES,
    opaque: bool = False,
    extra_files: Sequence[tuple[str, bytes, int]] = (),
) -> LayerFile:
    """Write ``src`` as a deterministic gzipped tar at ``out``, its content placed under ``dest``.

    :param src: the directory whose selected files go into the layer.
    :param out: where the ``.tar.gz`` goes.
    :param dest: directory inside the image (``/app/trainer``); empty for the archive root.
    :param excludes: patterns of paths to leave out (see :func:`select_files`).
    :param opaque: mark ``dest`` opaque, so files of lower layers there disappear (a code
        layer replaces the previous code instead of merging with it).
    :param extra_files: ``(path inside the archive, content, mode)`` added at their sorted place.
    """
    files = select_files(src, excludes)
    dest_path = PurePosixPath(dest.strip("/")) if dest.strip("/") else None
    if opaque and dest_path is None:
        raise ValueError("an opaque layer needs a destination directory, e.g. dest='/app/trainer'")
    prefix = dest_path.parts if dest_path else ()
    # (sort key, name in the archive, kind, content, mode)
    entries: list[tuple[tuple[str, ...], str, str, Path | bytes | None, int]] = []
    for i in range(1, len(prefix) + 1):
        entries.append((prefix[:i], "/".join(prefix[:i]), "dir", None, 0o755))
    if opaque:
        # The marker sorts first among the directory's children ("" < any name), as Docker writes it.
        entries.append(((*prefix, ""), f"{dest_path}/{OPAQUE_WHITEOUT}", "file", b"", 0o644))
    for rel in files:
        parts = (*prefix, *rel.parts)
        entries.append((parts, "/".join(parts), "path", src / rel, 0))
    for name, content, mode in extra_files:
        parts = PurePosixPath(name.strip("/")).parts
        entries.append((parts, "/".join(parts), "file", content, mode))
    entries.sort(key=lambda e: e[0])

    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as fh:
        compressed = _HashingWriter(fh)
        with gzip.GzipFile(
            filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=GZIP_LEVEL
        ) as gz:
            uncompressed = _HashingWriter(gz)
            # the stubs' fileobj protocol wants read/seek/tell/close too, which a "w|" stream never calls
            stream = cast("IO[bytes]", uncompressed)
            with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for _, name, kind, source, mode in entries:
                    _add(tar, name, kind, source, mode)
    return LayerFile(
        out,
        "sha256:" + compressed.sha.hexdigest(),
        compressed.size,
        "sha256:" + uncompressed.sha.hexdigest(),
        len(entries),
    )


def _add(tar: tarfile.TarFile, name: str, kind: str, source: Path | bytes | None, mode: int) -> None:
    if kind == "dir":
        tar.addfile(_tarinfo(name, tarfile.DIRTYPE, mode))
        return
    if kind == "file":
        assert isinstance(source, bytes)
        tar.addfile(_tarinfo(name, tarfile.REGTYPE, mode, len(source)), io.BytesIO(source))
        return
    assert isinstance(source, Path)
    st = source.lstat()
    if stat.S_ISLNK(st.st_mode):
        tar.addfile(_tarinfo(name, tarfile.SYMTYPE, 0o777, linkname=os.readlink(source)))
    elif stat.S_ISDIR(st.st_mode):
        tar.addfile(_tarinfo(name, tarfile.DIRTYPE, 0o755))
    elif stat.S_ISREG(st.st_mode):
        with source.open("rb") as fh:
            tar.addfile(_tarinfo(name, tarfile.REGTYPE, _mode(st.st_mode), st.st_size), fh)
    # sockets, fifos and devices have no place in a code layer: skipped
