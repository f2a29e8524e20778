"""Prepared copies as the sync tool moves them between pods: their layout, and the sidecar's upload.

A trainer that derives costly records from the dataset (decoded, checked, resized images:
trainer/image_classifier/prepare.py) keeps them in ``KUBETRAIN_PREPARED_DIR`` (default
``DATA_DIR/.kubetrain-prepared``), one folder per preprocessing key, published by a rename with
its ``manifest.json``. The checkpoint-sync sidecar uploads each such copy under
``KUBETRAIN_PREPARED_URI`` (``s3://<training bucket>/prepared/<dataset>/<version>/<key>/``) once:
every shard the manifest lists, each checked against the manifest's sha256 first, then the
manifest last, so a listed manifest means a complete copy. The stage-in of every later pod on
the same dataset version downloads it (:func:`trainer.sync.stagein.stage_prepared`): a run's
retries, a sweep's trials, a multi-node run's replicas and the next run prepare nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kubetrain_contract.s3uri import S3Uri
from trainer.sync.errors import S3RequestError
from trainer.sync.progress import human_bytes, log
from trainer.sync.sidecar_files import (
    SINGLE_PUT_LIMIT,
    Changed,
    Stat,
    hash_file_parts,
    part_size_of,
    read_all,
)
from trainer.sync.sidecar_pass import Stopped

if TYPE_CHECKING:
    from trainer.sync.sidecar_files import FileSync

PREPARED_DIR_NAME = ".kubetrain-prepared"
PREPARED_MANIFEST = "manifest.json"
# What a prepared copy's folder and shard names may be: nothing a listing could turn into a path elsewhere.
PREPARED_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHARD_NAME = re.compile(r"^shard-[0-9]{5,9}\.bin$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ListedShard:
    """A shard as a prepared copy's manifest lists it."""

    name: str
    bytes: int
    sha256: str


def listed_shards(doc: object) -> list[ListedShard]:
    """The shards a parsed ``manifest.json`` lists, each name, size and checksum checked.

    Raises:
        ValueError: naming the first entry that is not ``{"name": "shard-<number>.bin", "bytes": n,
            "sha256": "<64 hex digits>"}``, or no shard at all.
    """
    shards = doc.get("shards") if isinstance(doc, dict) else None
    if not isinstance(shards, list) or not shards:
        raise ValueError(f"{PREPARED_MANIFEST} lists no shards")
    found = []
    for shard in shards:
        if not isinstance(shard, dict):
            raise ValueError(f"shard entry {shard!r} is not an object")
        name, size, sha = shard.get("name"), shard.get("bytes"), shard.get("sha256")
        if not isinstance(name, str) or not SHARD_NAME.match(name):
            raise ValueError(f"shard name {name!r} is not shard-<number>.bin")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{name}: bytes {size!r} is not a whole number >= 0")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise ValueError(f"{name}: sha256 {sha!r} is not 64 lower-case hex digits")
        found.append(ListedShard(name, size, sha))
    return found


class NotUploaded(Exception):
    """A local copy that must not be uploaded: its manifest or its shards disagree (the message says how)."""


class PreparedUploads:
    """The sidecar's upload of the prepared copies in ``root`` to ``uri``, once per key per pod.

    A key whose manifest is already in S3 (staged by this pod, or uploaded by another) is only
    remembered. A copy whose manifest cannot be read or whose shards do not match it is logged and
    not looked at again until its manifest is replaced (the trainer refuses and remakes it).

    Args:
        files: the sidecar's one-file steps: its S3 access, puts and retries.
        uri: the dataset version's prefix, ``s3://<training bucket>/prepared/<dataset>/<version>/``.
        root: where the trainer keeps its copies (``KUBETRAIN_PREPARED_DIR``).
        stop: the sidecar's SIGTERM; a periodic round stops between two shards once it is set.
    """

    def __init__(self, files: FileSync, uri: S3Uri, root: Path, stop: threading.Event) -> None:
        self.files = files
        self.uri = uri
        self.root = root
        self.stop = stop
        self.done: set[str] = set()  # keys whose manifest is in S3
        self.refused: dict[str, Stat] = {}  # key -> its manifest file as it was refused
        self.sent: dict[str, dict[str, str]] = {}  # key -> shard name -> sha256 this pod uploaded
        self.uploaded_bytes = 0
        self.lock = threading.Lock()  # one round at a time: the periodic thread's or the final pass's

    def pending(self) -> list[str]:
        """Keys of the published local copies not in S3 yet: folders not starting with '.' holding a manifest."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return []  # no copy made yet
        return [
            name
            for name in names
            if name not in self.done
            and not name.startswith(".")
            and PREPARED_KEY.match(name)
            and (self.root / name / PREPARED_MANIFEST).is_file()
        ]

    def sync(self, deadline: float | None = None) -> list[str]:
        """Upload every published local copy that S3 lacks; the keys uploaded.

        Args:
            deadline: in the final pass, the ``time.monotonic()`` after which no shard is started;
                None for a periodic round, which SIGTERM stops instead.

        Raises:
            Stopped: SIGTERM (periodic round) or the deadline came between two shards; the copy's
                manifest is not uploaded, so the copy is not complete in S3.
            SyncError: S3 failed; the round is tried again later.
        """
        uploaded = []
        with self.lock:
            for key in self.pending():
                try:
                    if self._sync_copy(key, deadline):
                        uploaded.append(key)
                except NotUploaded as exc:
                    log(f"checkpoint-sync: WARNING: prepared copy {key} not uploaded: {exc}")
        return uploaded

    def _check_time(self, deadline: float | None) -> None:
        if (deadline is None and self.stop.is_set()) or (
            deadline is not None and time.monotonic() >= deadline
        ):
            raise Stopped()

    def _sync_copy(self, key: str, deadline: float | None) -> bool:
        folder = self.root / key
        try:
            manifest_stat = Stat.of(folder / PREPARED_MANIFEST)
        except OSError:
            return False  # taken away since the listing (the trainer refused it)
        if self.refused.get(key) == manifest_stat:
            return False
        base = self.uri.key.rstrip("/")
        prefix = f"{base}/{key}/" if base else f"{key}/"
        self._check_time(deadline)
        if self._in_s3(prefix + PREPARED_MANIFEST):
            self.done.add(key)
            log(f"checkpoint-sync: prepared copy {key} is already in s3://{self.uri.bucket}/{prefix}")
            return False
        try:
            body = (folder / PREPARED_MANIFEST).read_bytes()
            shards = listed_shards(json.loads(body))
            sent = self.sent.setdefault(key, {})
            total = 0
            for shard in shards:
                if sent.get(shard.name) == shard.sha256:
                    continue
                self._check_time(deadline)
                self._put_shard(folder / shard.name, shard, prefix + shard.name)
                sent[shard.name] = shard.sha256
                total += shard.bytes
        except (NotUploaded, ValueError, OSError) as exc:
            self.refused[key] = manifest_stat
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise NotUploaded(why) from exc
        self._check_time(deadline)
        sha = hashlib.sha256(body).hexdigest()
        self.files.retry(
            lambda: self.files.put_small(
                prefix + PREPARED_MANIFEST, body, sha, hashlib.md5(body).digest(), bucket=self.uri.bucket
            ),
            f"s3://{self.uri.bucket}/{prefix}{PREPARED_MANIFEST}",
        )
        self.done.add(key)
        self.uploaded_bytes += total + len(body)
        log(
            f"checkpoint-sync: prepared copy {key} uploaded to s3://{self.uri.bucket}/{prefix}: "
            f"{len(shards)} shards ({human_bytes(total)} sent now), manifest last"
        )
        return True

    def _in_s3(self, key: str) -> bool:
        try:
            self.files.s3.head(self.uri.bucket, key)
        except S3RequestError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _put_shard(self, path: Path, shard: ListedShard, key: str) -> None:
        """Upload one shard, its bytes checked against the manifest's size and sha256 first.

        Raises:
            NotUploaded: the file's size or sha256 is not the manifest's, or it changed while read.
        """
        size = os.stat(path).st_size
        if size != shard.bytes:
            raise NotUploaded(f"{shard.name} holds {size} bytes, the manifest says {shard.bytes}")
        what = f"s3://{self.uri.bucket}/{key}"
        try:
            if size <= SINGLE_PUT_LIMIT:
                data = read_all(path, size)
                sha = hashlib.sha256(data).hexdigest()
                self._check_sha(shard, sha)
                md5 = hashlib.md5(data).digest()
                self.files.retry(
                    lambda: self.files.put_small(key, data, sha, md5, bucket=self.uri.bucket), what
                )
            else:
                # the parts are read again as they are sent, each checked against its CRC from this read
                sha, crcs = hash_file_parts(path, part_size_of(size))
                self._check_sha(shard, sha)
                self.files.retry(
                    lambda: self.files.put_multipart(key, path, size, sha, crcs, bucket=self.uri.bucket), what
                )
        except Changed:
            raise NotUploaded(f"{shard.name} changed while it was read") from None

    @staticmethod
    def _check_sha(shard: ListedShard, sha: str) -> None:
        if sha != shard.sha256:
            raise NotUploaded(
                f"{shard.name}: sha256 {sha[:16]}..., the manifest says {shard.sha256[:16]}...: the copy is "
                "damaged (the trainer refuses it and prepares it again)"
            )
