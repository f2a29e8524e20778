"""The checkpoint-sync sidecar's work on one file: read it, hash it, upload it, check it held still.

What lands at a key is always a consistent snapshot whose sha256 is in the object's metadata: a
small file is read once into memory, hashed and sent from that same buffer; a large one is hashed
first and then sent as a multipart upload whose parts are checked against that first read before
the (atomic) completion. TensorFlow's checkpoint index goes after the files of the checkpoint it
names. :class:`FileSync` is that half of :class:`trainer.sync.sidecar.Sidecar`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from kubetrain_contract.manifests import Area, SyncPassFile
from trainer.sync.errors import S3RequestError, SyncError
from trainer.sync.progress import log
from trainer.sync.restore import SHA256_METADATA

if TYPE_CHECKING:
    from trainer.sync.s3 import S3
    from trainer.sync.sidecar import SyncConfig

MiB = 1024 * 1024
SINGLE_PUT_LIMIT = 16 * MiB
# TF and Keras write checkpoints as temporaries and rename them; editors and downloaders
# leave similar names behind. Any path component that matches is skipped.
TEMPORARY = re.compile(r"(\.tmp|_temp|\.partial$|\.part$|~$|^\.#|\.swp$|^\.kubetrain-)", re.IGNORECASE)
# TensorFlow's checkpoint index (a CheckpointState text proto, written by rename after the
# files it names). The sync image has no TensorFlow and so no checkpoint_state_pb2 to parse
# it with; the one field read here is a quoted string on its own line.
CHECKPOINT_INDEX = "checkpoint"
LATEST_CHECKPOINT = re.compile(rb'^model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"\s*$', re.MULTILINE)


def is_temporary(relative: str) -> bool:
    """Whether a relative path looks like a file still being written."""
    return any(TEMPORARY.search(part) for part in relative.split("/"))


@dataclass(frozen=True)
class Stat:
    """What tells a file version apart without reading it."""

    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> Stat:
        st = os.stat(path, follow_symlinks=False)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class Entry:
    """A file as the bucket holds it."""

    stat: Stat
    file: SyncPassFile


class Changed(Exception):
    """The file changed while it was read or sent."""


class FileSync:
    """The one-file steps of :class:`trainer.sync.sidecar.Sidecar`: upload a file, retry, check it held still.

    A mixin: it reads and updates the sidecar's ``s3``, ``config``, ``stop``, ``entries``
    (the current set), ``unsettled``, ``uploaded_files``, ``uploaded_bytes`` and
    ``_part_checksums``.
    """

    # the sidecar's attributes this mixin uses (set in Sidecar.__init__)
    s3: S3
    config: SyncConfig
    stop: threading.Event
    entries: dict[tuple[str, str], Entry]
    unsettled: bool
    uploaded_files: int
    uploaded_bytes: int
    _part_checksums: bool

    def retry(self, call, what: str):
        """``call()``, tried ``config.attempts`` times (a file that changed is not tried again).

        Raises:
            SyncError: naming ``what`` and the last failure.
        """
        # the CRT (and botocore under workload identity, standard mode, ``S3.max_attempts``)
        # already retry each request on 5xx, throttling and connection errors; this loop,
        # ``config.attempts`` times around them, retries what they cannot: a multipart upload
        # as a whole (a part or the completion that still fails leaves an aborted UploadId,
        # recovered only by a new create/parts/complete), a single put refused for its
        # Content-MD5 (a body damaged on the way) or whose ETag is not the MD5 sent, and a put
        # that got no answer in time. Around the pass manifest's one put it only adds attempts.
        delay = 0.2
        for attempt in range(1, self.config.attempts + 1):
            try:
                return call()
            except Changed:
                raise
            except Exception as exc:
                if attempt == self.config.attempts:
                    raise SyncError(f"{what}: failed after {attempt} attempts: {exc}") from exc
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)

    # -- one file ------------------------------------------------------------------------

    def _sync_file(
        self, ident: tuple[str, str], path: Path, recent: bool, final: bool, requests: threading.Semaphore
    ) -> bool:
        """Upload one file; True when it changed while it was read or sent (then it is not listed).

        ``requests``: the pass's permits, ``workers`` of them: a file holds one from its read to the
        end of its upload.
        """
        if self.stop.is_set() and not final:
            return False
        try:
            return self._sync_existing(ident, path, recent, final, requests)
        except FileNotFoundError:
            # deleted since the scan (trainers prune old checkpoints): no longer part of the set
            self.entries.pop(ident, None)
            return False

    def _sync_existing(
        self, ident: tuple[str, str], path: Path, recent: bool, final: bool, requests: threading.Semaphore
    ) -> bool:
        area, rel = ident
        key = f"{self.config.run.key.rstrip('/')}/{area}/{rel}"
        began = time.monotonic()
        before = Stat.of(path)
        entry = self.entries.get(ident)
        data: bytes | None = None
        # a permit of the pass's `requests` from the read to the end of the upload: at most
        # `workers` files read, held in memory and sent at once, as with `workers` threads
        requests.acquire()
        holding = True
        try:
            if before.size <= SINGLE_PUT_LIMIT:
                data = read_all(path, before.size)
                if Stat.of(path) != before:
                    raise Changed()
                if path.name == CHECKPOINT_INDEX:
                    # the files it names take permits of their own: this one is not held meanwhile
                    requests.release()
                    holding = False
                    self._sync_named_checkpoint(ident, path, data, final, requests)
                    requests.acquire()
                    holding = True
                sha = hashlib.sha256(data).hexdigest()
                if entry is not None and entry.file.sha256 == sha:
                    self.entries[ident] = Entry(before, entry.file)  # touched, not changed
                    return False
                md5 = hashlib.md5(data).digest()
                self.retry(
                    lambda: self.put_small(key, data, sha, md5), f"s3://{self.config.run.bucket}/{key}"
                )
            else:
                sha, part_crcs = hash_file_parts(path, part_size_of(before.size))
                if Stat.of(path) != before:
                    raise Changed()
                if entry is not None and entry.file.sha256 == sha:
                    self.entries[ident] = Entry(before, entry.file)
                    return False
                self.retry(
                    lambda: self.put_multipart(key, path, before.size, sha, part_crcs),
                    f"s3://{self.config.run.bucket}/{key}",
                )
        except Changed:
            self.unsettled = True
            log(f"checkpoint-sync: {area}/{rel} is still being written; not listed in this pass")
            return True
        finally:
            if holding:
                requests.release()
        data = None  # sent: a thread that waits for the file to settle below holds no copy of it
        if recent:
            # a file written just before SIGTERM (or in a pass that takes recent files) is
            # listed only if it then holds still
            time.sleep(max(0.0, self.config.settle - (time.monotonic() - began)))
        if Stat.of(path) != before:
            # the key now holds a consistent but possibly half-written snapshot: list nothing
            self.entries.pop(ident, None)
            self.unsettled = True
            log(f"checkpoint-sync: {area}/{rel} changed during its upload; not listed in this pass")
            return True
        self.entries[ident] = Entry(before, SyncPassFile(cast(Area, area), rel, key, before.size, sha))
        self.uploaded_files += 1
        self.uploaded_bytes += before.size
        return False

    def _sync_named_checkpoint(
        self, ident: tuple[str, str], path: Path, data: bytes, final: bool, requests: threading.Semaphore
    ) -> None:
        """Upload (if needed) the files of the checkpoint that an index version names, before the index.

        The trainer may save again between this pass's scan and the read of its index: the
        index read then names a checkpoint the scan did not see. Listing that index without
        those files would give a retried pod an index naming a checkpoint it does not have.

        Raises:
            Changed: the named checkpoint's files are gone or changed (the index is not
                listed in this pass).
        """
        match = LATEST_CHECKPOINT.search(data)
        if match is None:
            return
        named = match.group(1).decode("utf-8", "replace")
        area, rel = ident
        root = self.config.dirs[area]
        prefix = Path(named) if os.path.isabs(named) else path.parent / named
        try:
            prefix_rel = prefix.relative_to(root).as_posix()
        except ValueError:
            return  # a checkpoint outside the synced directory: not ours to upload
        files = sorted(prefix.parent.glob(f"{prefix.name}.*")) if prefix.parent.is_dir() else []
        if not any(f.name == f"{prefix.name}.index" for f in files):
            log(
                f"checkpoint-sync: {area}/{rel} names {prefix_rel}, whose files are gone; not listed in this pass"
            )
            raise Changed()
        sent: list[tuple[tuple[str, str], Path]] = []
        for dep in files:
            dep_ident = (area, dep.relative_to(root).as_posix())
            if is_temporary(dep_ident[1]):
                continue
            entry = self.entries.get(dep_ident)
            try:
                if entry is not None and entry.stat == Stat.of(dep):
                    continue
            except OSError:
                raise Changed() from None
            # a checkpoint's files are complete once an index names them: no quiet period; they
            # hold still for `settle` seconds around their uploads all together, below (one after
            # the other, each in turn, the data and index files took a second of every final pass)
            try:
                if self._sync_existing(dep_ident, dep, False, final, requests):
                    raise Changed()
            except FileNotFoundError:
                raise Changed() from None
            if dep_ident not in self.entries:
                raise Changed()
            if entry is None or self.entries[dep_ident].file is not entry.file:
                sent.append((dep_ident, dep))  # uploaded now (not only touched since its last upload)
        if not sent:
            return
        # every file's upload began before now, and each must be unchanged `settle` seconds after
        time.sleep(self.config.settle)
        for dep_ident, dep in sent:
            entry = self.entries.get(dep_ident)
            try:
                held = entry is not None and Stat.of(dep) == entry.stat
            except OSError:
                held = False
            if not held:
                self.entries.pop(dep_ident, None)
                self.unsettled = True
                log(
                    f"checkpoint-sync: {area}/{dep_ident[1]} changed after its upload; not listed in this pass"
                )
                raise Changed()

    def put_small(self, key: str, data: bytes, sha: str, md5: bytes, *, bucket: str | None = None) -> None:
        """Put ``data`` at ``key`` (of the run's bucket unless ``bucket``) with its sha256 in the metadata."""
        # through the CRT: botocore's per-request CPU is most of a small file's upload
        bucket = bucket or self.config.run.bucket
        headers = self.s3.put_bytes(
            bucket,
            key,
            data,
            content_md5=base64.b64encode(md5).decode(),
            metadata={SHA256_METADATA: sha},
        )
        etag = headers.get("etag", "").strip('"')
        if re.fullmatch(r"[0-9a-f]{32}", etag) and etag != md5.hex():
            raise SyncError(f"s3://{bucket}/{key}: the server's ETag {etag} is not the MD5 {md5.hex()} sent")

    def put_multipart(
        self, key: str, path: Path, size: int, sha: str, crcs: list[int], *, bucket: str | None = None
    ) -> None:
        """Upload a large file in parts, each read again and checked against ``crcs`` (its first read).

        Raises:
            Changed: a part no longer gives the CRC of the first read (the upload is aborted).
        """
        s3, bucket = self.s3, bucket or self.config.run.bucket
        # each part goes with the CRC32C its two reads were compared by, which the store checks
        # (no SHA-256 of every part to sign); a store that refuses part checksums gets the
        # parts signed with their SHA-256 instead
        with_crcs = self._part_checksums
        try:
            upload_id = s3.create_multipart_upload(
                bucket, key, {SHA256_METADATA: sha}, part_checksums=with_crcs
            )
        except S3RequestError as exc:
            if not with_crcs or exc.status not in (400, 501):
                raise
            log(
                f"checkpoint-sync: the store refused part checksums ({exc.code}); "
                "signing each part's SHA-256 instead"
            )
            self._part_checksums = with_crcs = False
            upload_id = s3.create_multipart_upload(bucket, key, {SHA256_METADATA: sha})
        part_size = part_size_of(size)
        etags = []
        try:
            with open(path, "rb") as f:
                for number, expected in enumerate(crcs, start=1):
                    data = os.pread(f.fileno(), part_size, (number - 1) * part_size)
                    if _part_crc(data) != expected:
                        raise Changed()
                    etags.append(
                        s3.upload_part(
                            bucket, key, upload_id, number, data, crc32c=expected if with_crcs else None
                        )
                    )
            s3.complete_multipart_upload(bucket, key, upload_id, etags, crc32cs=crcs if with_crcs else None)
        except BaseException:
            try:
                s3.abort_multipart_upload(bucket, key, upload_id)
            except Exception as exc:
                log(f"checkpoint-sync: WARNING: could not abort the multipart upload of {key}: {exc}")
            raise


def size_of(path: Path) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return 0


def part_size_of(size: int) -> int:
    """The part size of a multipart upload of ``size`` bytes."""
    # S3 allows at most 10,000 parts
    return max(16 * MiB, -(-size // (10_000 * MiB)) * MiB)


def read_all(path: Path, size: int) -> bytes:
    """The whole file, which must hold ``size`` bytes.

    Raises:
        Changed: it holds more or fewer.
    """
    with open(path, "rb") as f:
        data = f.read(size + 1)
    if len(data) != size:
        raise Changed()
    return data


def _part_crc(data: bytes) -> int:
    """What a part's second read is checked against the first by (a file rewritten in between),
    and the checksum the store checks the part by.

    A CRC32C (awscrt, hardware-accelerated: 0.05 to 0.15 CPU-seconds per GB, where an MD5
    costs 1.5, and twice, once per read).
    """
    from awscrt.checksums import crc32c

    return crc32c(data)


def hash_file_parts(path: Path, part_size: int) -> tuple[str, list[int]]:
    """The sha256 of a large file and the CRC of each of its parts, from one read."""
    sha = hashlib.sha256()
    crcs = []
    with open(path, "rb") as f:
        while data := f.read(part_size):
            sha.update(data)
            crcs.append(_part_crc(data))
    return sha.hexdigest(), crcs


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(8 * MiB):
            h.update(data)
    return h.hexdigest()
