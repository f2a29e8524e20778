"""Safe, atomic extraction of zip and tar archives.

An archive is extracted into a hidden temporary directory next to it and its entries are
renamed into place only when every member has been checked and written, so a refused or
failed archive leaves nothing behind. Refused, with the member named (``repr()``, so a NUL
byte or a control character shows): absolute paths, ``..`` components (also once the name
is Unicode-normalised, NFKC), NUL bytes, links whose target leaves the extraction directory
(resolved through the links already there: the archive's own, in any order, and those of
the directory it lands in), link targets longer than Linux allows, members written through
a link, members colliding with a directory or file of the same name, device files, FIFOs
and sockets, archive bombs (a compression ratio or a total size above the limits, counted
on the bytes actually written, not on the sizes the archive declares), too many members
(an absolute limit, one relative to the archive's size, and the target file system's free
inodes: checked before a zip's central directory is parsed, and as a tar's members come),
and damaged archives: a tar is read to the real end of its stream (a damaged or truncated
header, a zero block followed by more members, anything but zeros after the end-of-archive
blocks, a PAX size that contradicts its tar header, a truncated or corrupt gzip, bzip2 or
xz stream), a zip's central directory is walked before zipfile reads it. A tar is read as
a stream, one member at a time, and nothing is kept per member but a link's target, so
memory does not grow with the number of members.
"""

from __future__ import annotations

import errno
import io
import math
import os
import re
import secrets
import shutil
import stat
import tarfile
import unicodedata
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.sync.archive_read import (
    CHUNK,
    ArchiveError,
    Damaged,
    TarReader,
    walk_central_directory,
    zip_directory,
)

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")
# ratios are only meaningful past a minimum size: a 40-byte file compressed to 2 bytes is fine.
# The same floor serves a member of a zip and a whole archive (zip or tar), so a zip of many
# small, very compressible members cannot add up past the ratio: an archive writes at most
# max(RATIO_FLOOR_BYTES, max_ratio x its size).
RATIO_FLOOR_BYTES = 1024 * 1024
# Linux refuses longer link targets (PATH_MAX, 4096, counts the terminating NUL)
LINK_TARGET_MAX = 4095
# links followed while resolving one target before it counts as a loop, as Linux's own ELOOP
LINK_HOPS_MAX = 40
# an archive may always have this many members, whatever its size (the member-density limit's floor)
MEMBER_FLOOR = 10_000
# the share of a file system's inodes an archive leaves free: the kubelet evicts pods when a node's
# file system has less (its default hard-eviction threshold nodefs.inodesFree<5%), and emptyDir
# volumes live there
INODE_RESERVE = 0.05
# inodes created between two reads of the file system's free inodes (others create files too)
INODE_RECHECK = 4096


@dataclass(frozen=True)
class ExtractLimits:
    """Limits against archive bombs.

    Attributes:
        max_ratio: most uncompressed bytes per compressed byte, for each member of a zip and
            for a whole archive (zip or tar), against the archive's size on disk: the size the
            dataset manifest declares, which stage-in has verified. Below RATIO_FLOOR_BYTES
            (1 MiB) a member or an archive is not held to it.
        max_bytes: most bytes one archive may expand to.
        max_members: most members one archive may have.
        min_member_bytes: fewest bytes of the archive (its size on disk, as for max_ratio) per
            member: an archive may have at most ``max(MEMBER_FLOOR, size / min_member_bytes)``
            members (10,000 at least). 0: no such limit. The default, 8, is below the smallest
            real data measured (one-number label files: 15-22 bytes a member in a tar.gz); empty
            files take 6-17, so it stops only the densest floods early (trainer/sync/README.md,
            "Stage-in", has the figures).
    """

    max_ratio: float = 250.0
    max_bytes: int = 100 * 1024**3
    max_members: int = 1_000_000
    min_member_bytes: int = 8

    def __post_init__(self) -> None:
        if self.max_ratio < 1:
            raise ValueError(f"max_ratio {self.max_ratio} must be at least 1")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes {self.max_bytes} must be positive")
        if self.max_members < 1:
            raise ValueError(f"max_members {self.max_members} must be positive")
        if self.min_member_bytes < 0:
            raise ValueError(f"min_member_bytes {self.min_member_bytes} must be 0 (no limit) or more")


def is_archive(path: str) -> bool:
    """Whether ``path`` names an archive the tool extracts."""
    return path.lower().endswith(ARCHIVE_SUFFIXES)


def extract(archive: Path, limits: ExtractLimits, *, statvfs: Callable[[Any], Any] = os.statvfs) -> int:
    """Extract ``archive`` into the directory that holds it.

    Args:
        archive: a .zip, .tar, .tar.gz or .tgz file (a .tar may be gzip, bzip2 or xz compressed).
        limits: the archive-bomb limits.
        statvfs: reads the target file system's free inodes (``os.statvfs``; a test's stand-in
            for a file system running out of inodes).

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
        extractor = _Extractor(archive, tmp, limits, statvfs)
        if archive.name.lower().endswith(".zip"):
            extractor.zip()
        else:
            extractor.tar()
        extractor.check_links()
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
    def __init__(
        self, archive: Path, root: Path, limits: ExtractLimits, statvfs: Callable[[Any], Any]
    ) -> None:
        self.archive, self.root, self.limits = archive, root, limits
        self.members = 0
        self.total = 0
        self.size = archive.stat().st_size
        self.budget = max(RATIO_FLOOR_BYTES, int(self.size * limits.max_ratio))
        self.dense = (
            max(MEMBER_FLOOR, self.size // limits.min_member_bytes) if limits.min_member_bytes else None
        )
        self.inodes = _Inodes(statvfs, root)
        # the links this archive created: their path in the root -> (member name, target)
        self.links: dict[tuple[str, ...], tuple[str, str]] = {}

    def refuse(self, member: str, reason: str) -> ArchiveError:
        return ArchiveError(f"archive {self.archive.name}: member {member!r}: {reason}; refused")

    @contextmanager
    def member(self, name: str) -> Iterator[None]:
        """Refuse, naming the member, what the file system refuses while it is written."""
        try:
            yield
        except (FileExistsError, IsADirectoryError) as exc:
            raise self.refuse(
                name, "appears twice, or collides with an earlier directory, file or link of the same name"
            ) from exc
        except NotADirectoryError as exc:
            raise self.refuse(name, "its path goes through a file of this archive") from exc
        except OSError as exc:
            if exc.errno is None or exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # not the file system's (a corrupt gzip stream), or extract() names the full directory
            raise self.refuse(name, f"cannot be written ({exc.strerror or exc})") from exc
        except ValueError as exc:
            raise self.refuse(name, f"cannot be written ({exc})") from exc

    def safe_path(self, name: str) -> Path | None:
        """The member's path inside the root, or None for the archive root itself."""
        if "\x00" in name:
            raise self.refuse(name, "NUL byte in the name")
        # a name that only becomes absolute or '..' once normalised is refused too: a tool or a
        # file system that normalises (macOS, an NFKC-folding consumer) would otherwise see it
        for form, note in (
            (name, ""),
            (unicodedata.normalize("NFKC", name), " once Unicode-normalised (NFKC)"),
        ):
            if form.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", form):
                raise self.refuse(name, f"absolute path{note}")
            if ".." in re.split(r"[/\\]", form):
                raise self.refuse(name, f"path with '..'{note}")
        parts = [p for p in re.split(r"[/\\]", name) if p not in ("", ".")]
        if not parts:
            return None
        # never write through a link an earlier member created
        here = self.root
        for part in parts[:-1]:
            here = here / part
            if here.is_symlink():
                raise self.refuse(name, f"path goes through the link {here.relative_to(self.root)}")
            if here.exists() and not here.is_dir():
                raise self.refuse(name, f"its directory {str(here.relative_to(self.root))!r} is a file")
        path = self.root.joinpath(*parts)
        if path.is_symlink():
            raise self.refuse(name, "would overwrite a link")
        return path

    def check_link(self, name: str, path: Path, target: str) -> None:
        """Refuse a link whose target is unsafe, resolved through the links already there."""
        if "\x00" in target:
            raise self.refuse(name, f"NUL byte in the link target {target!r}")
        if len(target.encode("utf-8", "surrogateescape")) > LINK_TARGET_MAX:
            raise self.refuse(name, f"link target longer than {LINK_TARGET_MAX:,} bytes")
        if target.startswith("/") or re.match(r"^[A-Za-z]:", target):
            raise self.refuse(name, f"link to the absolute path {target!r} escapes the target")
        rel = path.relative_to(self.root).parts
        why, via = self.resolve(rel[:-1], target)
        if why:
            through = f" through the link {'/'.join(via[-1][0])!r}" if via else ""
            raise self.refuse(name, f"link to {target!r} {why}{through}")
        self.links[rel] = (name, target)

    def lookup(self, rel: tuple[str, ...]) -> tuple[str | None, bool]:
        """The target of the link at ``rel`` once the archive is moved into place, and whose it is.

        Returns:
            The link's target (None: not a link, or nothing there) and whether this archive
            made it. What the archive holds wins over the directory it lands in, as in _move.
        """
        for base, ours in ((self.root, True), (self.archive.parent, False)):
            path = base.joinpath(*rel)
            try:
                if not stat.S_ISLNK(os.lstat(path).st_mode):
                    return None, ours
                return os.readlink(path), ours
            except OSError:
                continue
        return None, False

    def resolve(
        self, where: tuple[str, ...], target: str
    ) -> tuple[str | None, list[tuple[tuple[str, ...], bool]]]:
        """Follow ``target`` from the directory ``where`` the way the kernel will, link by link.

        Returns:
            Why it is unsafe ("escapes the target", "is a loop of links") or None, and the links
            followed on the way: (path, made by this archive).
        """
        here = list(where)
        todo = list(reversed(target.split("/")))
        via: list[tuple[tuple[str, ...], bool]] = []
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if not here:
                    return "escapes the target", via
                here.pop()
                continue
            here.append(part)
            link, ours = self.lookup(tuple(here))
            if link is None:
                continue
            via.append((tuple(here), ours))
            if len(via) > LINK_HOPS_MAX:
                return "is a loop of links", via
            if link.startswith("/"):
                return "escapes the target", via
            here.pop()
            todo.extend(reversed(link.split("/")))
        return None, via

    def check_links(self) -> None:
        """Resolve every link again once all members are there, before anything is moved.

        A link checked when it was created may be redirected by a later one (``esc ->
        a/up/..`` before ``a/up -> ..``), and the links of the directory the archive lands in
        (an archive extracted there earlier) may be redirected by this archive's.
        """
        if not self.links:
            return
        for rel, (name, target) in self.links.items():
            why, via = self.resolve(rel[:-1], target)
            if why:
                through = f" through the link {'/'.join(via[-1][0])!r}" if via else ""
                raise self.refuse(name, f"link to {target!r} {why}{through}")
        for rel in _links_under(self.archive.parent, skip=self.root):
            why, via = self.resolve(rel[:-1], os.readlink(self.archive.parent.joinpath(*rel)))
            ours = [path for path, made_here in via if made_here]
            if why and ours:
                name, _ = self.links[ours[0]]
                raise self.refuse(name, f"the existing link {'/'.join(rel)!r} {why} through this link")

    def count(self, name: str) -> None:
        self.members += 1
        self.check_count(name, self.members)

    def check_count(self, name: str, n: int) -> None:
        """Refuse the ``n``-th member, ``name``, when it is one too many."""
        if n > self.limits.max_members:
            raise self.refuse(
                name,
                f"more than {self.limits.max_members:,} members (limit), the setting --max-extract-members",
            )
        if self.dense is not None and n > self.dense:
            raise self.refuse(
                name,
                f"more than {self.dense:,} members (member-density limit: one member per "
                f"{self.limits.min_member_bytes:,} bytes of its {self.size:,}, at least {MEMBER_FLOOR:,}; "
                "the setting --min-extract-member-bytes): inode bomb?",
            )

    def inode(self, name: str) -> None:
        """Count an inode about to be created for ``name``; refuse past the file system's free inodes."""
        if why := self.inodes.take():
            raise self.refuse(name, why)

    def mkdirs(self, name: str, directory: Path) -> None:
        """Create ``directory`` and its missing parents, counting their inodes (``mkdir -p``)."""
        missing: list[Path] = []
        here = directory
        while True:
            try:
                st = os.lstat(here)
            except FileNotFoundError:
                missing.append(here)
                here = here.parent
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(here))
            break
        for here in reversed(missing):
            self.inode(name)
            os.mkdir(here)

    def check_budget(self, name: str, more: int) -> None:
        """Refuse when ``more`` bytes would take the archive past its whole-archive ratio limit."""
        if self.total + more > self.budget:
            raise self.refuse(
                name,
                f"archive expands beyond {self.budget:,} bytes, the whole-archive ratio limit "
                f"({self.limits.max_ratio:g}x its {self.size:,} compressed bytes, at least "
                f"{RATIO_FLOOR_BYTES:,}): archive bomb?",
            )

    def write(self, name: str, path: Path, source, mode: int, budget: int | None) -> None:
        """Copy ``source`` to ``path``, stopping at the archive's limits and at ``budget`` bytes.

        ``budget`` is the member's own ratio limit (zip); None for a tar, whose whole stream is
        held to the ratio instead (check_budget).
        """
        self.mkdirs(name, path.parent)
        self.inode(name)
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
                self.check_budget(name, 0)
                if budget is not None and written > budget:
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
            raw = open(self.archive, "rb")
        except OSError as exc:
            raise ArchiveError(f"archive {self.archive.name}: not a readable zip file ({exc})") from exc
        with raw:
            entries = self.zip_precheck(raw)
        try:
            zf = zipfile.ZipFile(self.archive)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ArchiveError(f"archive {self.archive.name}: not a readable zip file ({exc})") from exc
        with zf:
            if len(zf.infolist()) != entries:  # zipfile found other entries than the walk: never trust either
                raise ArchiveError(
                    f"archive {self.archive.name}: damaged: zipfile reads {len(zf.infolist()):,} entries in its "
                    f"central directory, {entries:,} were counted there; refused"
                )
            for info in zf.infolist():
                self.count(info.filename)
                with self.member(info.filename):
                    self.zip_member(zf, info)

    def zip_precheck(self, raw: io.BufferedReader) -> int:
        """Count a zip's entries in its central directory before zipfile reads it into memory.

        zipfile keeps every entry (about 600 bytes each): a zip of millions of entries would take
        the memory before the member limit saw them. The walk keeps nothing, and stops at the first
        entry one too many (by the member limits or by the target file system's free inodes).

        Returns:
            The number of entries.
        """
        try:
            start, size, declared, zip64 = zip_directory(raw)
        except ValueError as exc:
            raise ArchiveError(f"archive {self.archive.name}: not a readable zip file ({exc})") from exc
        caps = [c for c in (self.limits.max_members, self.dense, self.inodes.budget) if c is not None]
        try:
            n, name = walk_central_directory(raw, start, size, min(caps))
        except ValueError as exc:
            raise ArchiveError(f"archive {self.archive.name}: damaged: {exc}; refused") from exc
        if name is not None:
            self.check_count(name, n)
            raise self.refuse(name, self.inodes.shortage())
        # zip64 counts are exact; a plain end record's 16 bits may have wrapped (old writers)
        if (n if zip64 else n % 0x10000) != declared:
            raise ArchiveError(
                f"archive {self.archive.name}: damaged: its end record declares {declared:,} entries, its "
                f"central directory holds {n:,}; refused"
            )
        return n

    def zip_member(self, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
        path = self.safe_path(info.filename)
        mode = info.external_attr >> 16
        kind = stat.S_IFMT(mode)
        if path is None:
            return
        if kind in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK):
            raise self.refuse(info.filename, "device file, FIFO or socket")
        budget = max(RATIO_FLOOR_BYTES, int(info.compress_size * self.limits.max_ratio))
        if info.file_size > budget:
            raise self.refuse(
                info.filename,
                f"declares {info.file_size:,} bytes from {info.compress_size:,} compressed, beyond the "
                f"{self.limits.max_ratio:g}x ratio limit: archive bomb?",
            )
        self.check_budget(info.filename, info.file_size)
        try:
            if kind == stat.S_IFLNK:
                with zf.open(info) as source:
                    raw = source.read(LINK_TARGET_MAX + 1)
                if len(raw) > LINK_TARGET_MAX:
                    raise self.refuse(info.filename, f"link target longer than {LINK_TARGET_MAX:,} bytes")
                target = raw.decode("utf-8", "surrogateescape")
                self.check_link(info.filename, path, target)
                self.mkdirs(info.filename, path.parent)
                self.inode(info.filename)
                os.symlink(target, path)
            elif info.is_dir():
                self.mkdirs(info.filename, path)
            else:
                with zf.open(info) as source:
                    self.write(info.filename, path, source, mode or 0o644, budget)
        except (zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as exc:
            raise self.refuse(info.filename, f"cannot be read ({exc})") from exc

    # -- tar -----------------------------------------------------------------------------

    def tar(self) -> None:
        try:
            raw = open(self.archive, "rb")
        except OSError as exc:
            raise ArchiveError(f"archive {self.archive.name}: not a readable tar file ({exc})") from exc
        with raw:
            reader = TarReader(raw, self.archive.name)
            try:
                for member in reader:
                    self.count(member.name)
                    with self.member(member.name):
                        self.tar_member(reader.tf, member)
                reader.check_end(max(self.budget - self.total, RATIO_FLOOR_BYTES))
            except (Damaged, tarfile.TarError) as exc:
                raise reader.explain(exc) from exc

    def tar_member(self, tf: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        # the root is a fresh directory only this archive writes: a file there is one of its files
        path = self.safe_path(member.name)
        if path is None:
            return
        if member.isdir():
            self.mkdirs(member.name, path)
        elif member.isreg():
            if _is_file(path):
                path.unlink()  # tar's rule: a later member of the same name replaces the earlier
            source = tf.extractfile(member)
            self.write(member.name, path, source, member.mode, None)
        elif member.issym():
            self.check_link(member.name, path, member.linkname)
            self.mkdirs(member.name, path.parent)
            self.inode(member.name)
            os.symlink(member.linkname, path)
        elif member.islnk():
            try:
                target = self.safe_path(member.linkname)
            except ArchiveError:
                target = None
            if target is None or not _is_file(target):
                raise self.refuse(
                    member.name,
                    f"hard link to {member.linkname!r}, which is not a file of this archive",
                )
            self.mkdirs(member.name, path.parent)
            os.link(target, path)
        elif member.ischr() or member.isblk() or member.isfifo():
            raise self.refuse(member.name, "device file or FIFO")
        else:
            raise self.refuse(member.name, f"unsupported member type {member.type!r}")


class _Inodes:
    """The target file system's free inodes, as an archive takes them.

    An archive may create inodes (files, directories, symbolic links; a hard link takes none)
    down to INODE_RESERVE of the file system's, looking at the file system again every
    INODE_RECHECK inodes (other pods create files too) and before refusing. A file system that
    counts no inodes (``f_files`` 0) sets no limit.
    """

    def __init__(self, statvfs: Callable[[Any], Any], root: Path) -> None:
        self.statvfs, self.root = statvfs, root
        self.used = 0
        # how many this archive may have used when the file system is next looked at (None: no limit)
        self.budget: int | None = None
        self.check_at = 0
        self.seen = (0, 0, 0)
        self.look()

    def look(self) -> None:
        """Read the file system's inodes, free inodes and reserve; set the budget."""
        try:
            st = self.statvfs(self.root)
        except OSError:
            return
        if st.f_files <= 0:  # btrfs, some network and FUSE file systems: no fixed number of inodes
            self.budget = None
            return
        reserve = math.ceil(st.f_files * INODE_RESERVE)
        self.seen = (st.f_files, st.f_favail, reserve)
        # those used so far (all but the one about to be) are no longer free
        self.budget = max(self.used - 1, 0) + st.f_favail - reserve
        self.check_at = self.used + INODE_RECHECK

    def take(self) -> str | None:
        """Count an inode about to be created; why it is refused, or None."""
        self.used += 1
        if self.budget is None or (self.used <= self.budget and self.used < self.check_at):
            return None
        self.look()
        if self.budget is not None and self.used > self.budget:
            return self.shortage()
        return None

    def shortage(self) -> str:
        self.look()
        files, free, reserve = self.seen
        return (
            f"more than {max(self.budget or 0, 0):,} new files, directories and links (inode limit: "
            f"the target file system has {files:,} inodes, {free:,} free now, and {reserve:,} of them, "
            f"{INODE_RESERVE:.0%}, are kept free: the kubelet evicts pods below that): inode bomb?"
        )


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _links_under(directory: Path, skip: Path) -> Iterator[tuple[str, ...]]:
    """The links below ``directory`` (not following any), as paths relative to it."""
    stack: list[tuple[str, ...]] = [()]
    while stack:
        rel = stack.pop()
        with os.scandir(directory.joinpath(*rel)) as entries:
            for entry in entries:
                if entry.is_symlink():
                    yield (*rel, entry.name)
                elif entry.is_dir(follow_symlinks=False) and Path(entry.path) != skip:
                    stack.append((*rel, entry.name))
