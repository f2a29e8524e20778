"""Safe, atomic extraction of zip and tar archives.

An archive is extracted into a hidden temporary directory next to it and its entries are
renamed into place only when every member has been checked and written, so a refused or
failed archive leaves nothing behind. Refused, with the member named: absolute paths,
``..`` components, links whose target leaves the extraction directory, members written
through a link, device files, FIFOs and sockets, and archive bombs (a compression ratio
or a total size above the limits, counted on the bytes actually written, not on the sizes
the archive declares).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from trainer.sync.s3 import SyncError

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")
CHUNK = 1024 * 1024
# ratios are only meaningful past a minimum size: a 40-byte file compressed to 2 bytes is fine
RATIO_FLOOR_BYTES = 1024 * 1024


class ArchiveError(SyncError):
    """An archive was refused or could not be extracted."""


@dataclass(frozen=True)
class ExtractLimits:
    """Limits against archive bombs.

    Attributes:
        max_ratio: most uncompressed bytes per compressed byte (per member for zip, for the
            whole stream for tar.gz).
        max_bytes: most bytes one archive may expand to.
        max_members: most members one archive may have.
    """

    max_ratio: float = 250.0
    max_bytes: int = 100 * 1024**3
    max_members: int = 1_000_000

    def __post_init__(self) -> None:
        if self.max_ratio < 1:
            raise ValueError(f"max_ratio {self.max_ratio} must be at least 1")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes {self.max_bytes} must be positive")
        if self.max_members < 1:
            raise ValueError(f"max_members {self.max_members} must be positive")


def is_archive(path: str) -> bool:
    """Whether ``path`` names an archive the tool extracts."""
    return path.lower().endswith(ARCHIVE_SUFFIXES)


def extract(archive: Path, limits: ExtractLimits) -> int:
    """Extract ``archive`` into the directory that holds it.

    Args:
        archive: a .zip, .tar, .tar.gz or .tgz file.
        limits: the archive-bomb limits.

    Returns:
        The number of files, links and directories extracted.

    Raises:
        ArchiveError: naming the archive and the offending member.
    """
    target = archive.parent
    tmp = target / f".kubetrain-extract-{secrets.token_hex(6)}"
    try:
        tmp.mkdir()
    except OSError as exc:
        raise ArchiveError(f"cannot extract {archive.name}: cannot create {tmp}: {exc.strerror}") from exc
    try:
        extractor = _Extractor(archive, tmp, limits)
        if archive.name.lower().endswith(".zip"):
            extractor.zip()
        else:
            extractor.tar()
        for entry in sorted(os.listdir(tmp)):
            _move(tmp / entry, target / entry, archive)
        return extractor.members
    except OSError as exc:
        if exc.errno == 28:
            raise ArchiveError(f"cannot extract {archive.name}: no space left on device in {target}") from exc
        raise ArchiveError(f"cannot extract {archive.name}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move(src: Path, dst: Path, archive: Path) -> None:
    if not dst.exists() and not dst.is_symlink():
        os.rename(src, dst)
    elif src.is_dir() and not src.is_symlink() and dst.is_dir() and not dst.is_symlink():
        for entry in sorted(os.listdir(src)):
            _move(src / entry, dst / entry, archive)
    else:
        raise ArchiveError(f"archive {archive.name}: {src.name} would replace the existing {dst}; refused")


class _Extractor:
    def __init__(self, archive: Path, root: Path, limits: ExtractLimits) -> None:
        self.archive, self.root, self.limits = archive, root, limits
        self.members = 0
        self.total = 0

    def refuse(self, member: str, reason: str) -> ArchiveError:
        return ArchiveError(f"archive {self.archive.name}: member {member!r}: {reason}; refused")

    def safe_path(self, name: str) -> Path | None:
        """The member's path inside the root, or None for the archive root itself."""
        if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
            raise self.refuse(name, "absolute path")
        parts = [p for p in re.split(r"[/\\]", name) if p not in ("", ".")]
        if ".." in parts:
            raise self.refuse(name, "path with '..'")
        if not parts:
            return None
        # never write through a link an earlier member created
        here = self.root
        for part in parts[:-1]:
            here = here / part
            if here.is_symlink():
                raise self.refuse(name, f"path goes through the link {here.relative_to(self.root)}")
        path = self.root.joinpath(*parts)
        if path.is_symlink():
            raise self.refuse(name, "would overwrite a link")
        return path

    def check_link(self, name: str, path: Path, target: str) -> None:
        if target.startswith("/") or re.match(r"^[A-Za-z]:", target):
            raise self.refuse(name, f"link to the absolute path {target!r} escapes the target")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path.relative_to(self.root)), target))
        if resolved == ".." or resolved.startswith(("../", "/")):
            raise self.refuse(name, f"link to {target!r} escapes the target")

    def count(self, name: str) -> None:
        self.members += 1
        if self.members > self.limits.max_members:
            raise self.refuse(name, f"more than {self.limits.max_members:,} members (limit)")

    def write(self, name: str, path: Path, source, mode: int, budget: int) -> None:
        """Copy ``source`` to ``path``, stopping at ``budget`` bytes for this member."""
        path.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while chunk := source.read(CHUNK):
                written += len(chunk)
                self.total += len(chunk)
                if self.total > self.limits.max_bytes:
                    raise self.refuse(
                        name,
                        f"archive expands beyond {self.limits.max_bytes:,} bytes (size limit): archive bomb?",
                    )
                if written > budget:
                    raise self.refuse(
                        name,
                        f"expands beyond {self.limits.max_ratio:g}x its compressed size (ratio limit): archive bomb?",
                    )
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.chmod(path, (mode & 0o755) | 0o600)

    # -- zip -----------------------------------------------------------------------------

    def zip(self) -> None:
        try:
            zf = zipfile.ZipFile(self.archive)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ArchiveError(f"archive {self.archive.name}: not a readable zip file ({exc})") from exc
        with zf:
            for info in zf.infolist():
                self.count(info.filename)
                path = self.safe_path(info.filename)
                mode = info.external_attr >> 16
                kind = stat.S_IFMT(mode)
                if path is None:
                    continue
                if kind in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK):
                    raise self.refuse(info.filename, "device file, FIFO or socket")
                budget = max(RATIO_FLOOR_BYTES, int(info.compress_size * self.limits.max_ratio))
                if info.file_size > budget:
                    raise self.refuse(
                        info.filename,
                        f"declares {info.file_size:,} bytes from {info.compress_size:,} compressed, beyond the "
                        f"{self.limits.max_ratio:g}x ratio limit: archive bomb?",
                    )
                try:
                    if kind == stat.S_IFLNK:
                        target = zf.read(info)[:4096].decode("utf-8", "replace")
                        self.check_link(info.filename, path, target)
                        path.parent.mkdir(parents=True, exist_ok=True)
                        os.symlink(target, path)
                    elif info.is_dir():
                        path.mkdir(parents=True, exist_ok=True)
                    else:
                        with zf.open(info) as source:
                            self.write(info.filename, path, source, mode or 0o644, budget)
                except (zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as exc:
                    raise self.refuse(info.filename, f"cannot be read ({exc})") from exc
                except FileExistsError as exc:
                    raise self.refuse(info.filename, "appears twice or collides with a directory") from exc

    # -- tar -----------------------------------------------------------------------------

    def tar(self) -> None:
        compressed = self.archive.stat().st_size
        budget = max(RATIO_FLOOR_BYTES, int(compressed * self.limits.max_ratio))
        try:
            tf = tarfile.open(self.archive, "r:*")
        except (tarfile.TarError, OSError) as exc:
            raise ArchiveError(f"archive {self.archive.name}: not a readable tar file ({exc})") from exc
        regular: set[Path] = set()
        try:
            with tf:
                for member in tf:
                    self.count(member.name)
                    path = self.safe_path(member.name)
                    if path is None:
                        continue
                    if member.isdir():
                        path.mkdir(parents=True, exist_ok=True)
                    elif member.isreg():
                        if path in regular:
                            path.unlink()
                        source = tf.extractfile(member)
                        self.write(member.name, path, source, member.mode, budget - self.total)
                        regular.add(path)
                    elif member.issym():
                        self.check_link(member.name, path, member.linkname)
                        path.parent.mkdir(parents=True, exist_ok=True)
                        os.symlink(member.linkname, path)
                    elif member.islnk():
                        try:
                            target = self.safe_path(member.linkname)
                        except ArchiveError:
                            target = None
                        if target is None or target not in regular:
                            raise self.refuse(
                                member.name,
                                f"hard link to {member.linkname!r}, which is not a file of this archive",
                            )
                        path.parent.mkdir(parents=True, exist_ok=True)
                        os.link(target, path)
                    elif member.ischr() or member.isblk() or member.isfifo():
                        raise self.refuse(member.name, "device file or FIFO")
                    else:
                        raise self.refuse(member.name, f"unsupported member type {member.type!r}")
        except ArchiveError:
            raise
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            raise ArchiveError(f"archive {self.archive.name}: corrupt or truncated ({exc})") from exc
