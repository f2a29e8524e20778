"""The S3 gateway of kubetrain's Airflow side, and the repositories of its documents.

:class:`RunStore` reads and writes objects, nothing more, through the amazon provider's S3Hook,
so connection, retries, endpoint and credentials are the provider's: calls go through the
hook's own methods (``head_object``, ``load_bytes``, ``iter_file_metadata``, ``list_keys``,
``list_prefixes``, ``copy_object``, ``delete_objects``) or its boto3 client (``hook.conn``):
reads are one GetObject each (the hook's ``get_key`` adds a HeadObject and a resource object;
:meth:`RunStore.read_many` has the figures), and an object a browser shows is uploaded with its
Content-Type as ``load_bytes`` uploads (the hook's ExtraArgs and transfer config).

What the objects are is the repositories' business (:mod:`kubetrain.store`), one per document
type, reached as attributes: ``store.passes`` (sync pass manifests), ``store.models`` (promoted
models and their ``latest`` pointer), ``store.promotions`` (promotion history), ``store.runs``
(run records and their indexes), ``store.markers`` (train-once markers), ``store.manifests``
(staged dataset manifests) and ``store.reports`` (run reports).

Failures have classes: :class:`FinalPassPending` (the sidecar is not done yet: wait) and
:class:`SyncVerificationError` (what S3 holds is not what the final pass promised: fail).
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kubetrain.s3_layout import S3Layout, s3_uri
from kubetrain.store.manifests import ManifestRepository
from kubetrain.store.markers import MarkerRepository
from kubetrain.store.models import MAX_COPY_BYTES, POINTER_KIND, ModelRepository
from kubetrain.store.passes import (
    MAX_LISTED_PROBLEMS,
    FinalPassPending,
    PassRepository,
    SyncPass,
    SyncVerificationError,
    checkpoint_group,
)
from kubetrain.store.promotions import PromotionRepository
from kubetrain.store.reports import CONTENT_TYPES, ReportRepository
from kubetrain.store.runs import RunRepository

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook


__all__ = [
    "CONTENT_TYPES",
    "MAX_COPY_BYTES",
    "MAX_LISTED_PROBLEMS",
    "POINTER_KIND",
    "FinalPassPending",
    "RunStore",
    "SyncPass",
    "SyncVerificationError",
    "checkpoint_group",
    "is_missing_key",
    "parse_bool",
]

_MISSING_CODES = ("404", "NoSuchKey", "NotFound")


def is_missing_key(exc: BaseException) -> bool:
    """Whether ``exc`` is S3's answer for an object that does not exist (not for a missing bucket).

    A HEAD answer has no body, so its code is the bare status ``404``.
    """
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in _MISSING_CODES


def parse_bool(name: str, value: Any) -> bool:
    """A bool, or the text a Param renders to (``True``, ``false``, ``1``, ``0``, ``yes``, ``no``).

    :param name: the argument, for the error message.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: expected true or false")


def _json(bucket: str, key: str, body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{s3_uri(bucket, key)} is not valid JSON: {exc}") from exc


class RunStore:
    """kubetrain's objects in S3, read and written through one S3Hook, and the repositories over them.

    :param hook: the amazon provider's S3 hook (the operators' cached ``hook``).
    :param layout: bucket names and key scheme.
    """

    def __init__(self, hook: S3Hook, layout: S3Layout) -> None:
        self.hook = hook
        self.layout = layout
        self.passes = PassRepository(self)
        self.models = ModelRepository(self)
        self.promotions = PromotionRepository(self)
        self.runs = RunRepository(self)
        self.markers = MarkerRepository(self)
        self.manifests = ManifestRepository(self)
        self.reports = ReportRepository(self)

    # -- objects -------------------------------------------------------------------------------

    def head(self, bucket: str, key: str) -> dict[str, Any] | None:
        """The object's metadata (``ContentLength``, ``ETag``, ``Metadata``), or ``None`` when it is missing."""
        return self.hook.head_object(key, bucket)

    def head_many(
        self, bucket: str, keys: Sequence[str], *, workers: int = 8
    ) -> dict[str, dict[str, Any] | None]:
        """:meth:`head` of each of ``keys``, in parallel: key -> metadata (``None`` where missing).

        A final sync pass lists a run's checkpoint and output files, ten to a few hundred: one
        HeadObject after the other cost 0.6 s per sweep trial under a sweep's load (bench/README.md,
        "sweep").
        """
        return self._each(lambda key: self.head(bucket, key), keys, workers)

    def read(self, bucket: str, key: str) -> bytes | None:
        """The object's bytes, or ``None`` when it is missing.

        One GetObject on the hook's boto3 client (``hook.conn``): the hook's ``get_key`` sends a
        HeadObject before it and builds a boto3 resource object per call, twice the requests for a
        document of a few KB (see :meth:`read_many`'s measurements).
        """
        try:
            return self.hook.conn.get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as exc:
            if is_missing_key(exc):
                return None
            raise

    def read_files(self, bucket: str, keys: Sequence[str], *, workers: int = 8) -> dict[str, bytes | None]:
        """The objects at ``keys`` (bytes, ``None`` where missing), read in parallel: key -> bytes."""
        return self._each(lambda key: self.read(bucket, key), keys, workers)

    def _each(self, call: Callable[[str], Any], keys: Sequence[str], workers: int) -> dict[str, Any]:
        """``call(key)`` for each distinct key, in parallel on the hook's one client: key -> result."""
        from concurrent.futures import ThreadPoolExecutor

        unique = list(dict.fromkeys(keys))
        if len(unique) <= 1:
            return {key: call(key) for key in unique}
        with ThreadPoolExecutor(max_workers=max(1, min(workers, self._pool_size(), len(unique)))) as pool:
            return dict(zip(unique, pool.map(call, unique), strict=True))

    def _pool_size(self) -> int:
        # no more threads than the client keeps connections (botocore's max_pool_connections, 10 by default)
        return getattr(self.hook.conn.meta.config, "max_pool_connections", None) or 10

    def read_json(self, bucket: str, key: str) -> Any | None:
        """The object decoded as JSON, or ``None`` when it is missing; a broken document is named in the error."""
        body = self.read(bucket, key)
        return None if body is None else _json(bucket, key, body)

    def read_many(self, bucket: str, keys: Sequence[str], *, workers: int = 16) -> list[Any | None]:
        """The JSON documents at ``keys``, read in parallel, in the order given (``None`` where missing).

        Threads share the hook's boto3 client (``hook.conn``). Measured on the dev stack's S3 server,
        50 documents of 2 KB (a page of runs): 100 ms as 10 threads of ``get_object`` on the client;
        320 ms through ``get_key`` on a pool of 10 S3Hooks (``get_key`` sends a HEAD before each
        GET, and its boto3 resource may not be shared between threads, so each thread needs a hook
        of its own), plus 5.7 s to create those hooks; 420 ms through ``get_key`` on one hook,
        one key after the other.

        :param workers: at most this many reads at once.
        """
        bodies = self.read_files(bucket, keys, workers=workers)
        return [None if (body := bodies[key]) is None else _json(bucket, key, body) for key in keys]

    def write(self, bucket: str, key: str, body: bytes | str, *, content_type: str | None = None) -> str:
        """Write (or replace) an object; return its URI.

        :param content_type: the object's Content-Type (default: S3's, ``binary/octet-stream``).
        """
        data = body.encode() if isinstance(body, str) else body
        if not content_type:
            self.hook.load_bytes(data, key=key, bucket_name=bucket, replace=True)
            return s3_uri(bucket, key)
        # What the hook's load_bytes does (upload_fileobj on its client, with its ExtraArgs and
        # transfer config), plus the Content-Type, which S3Hook takes only from a hook's own
        # extra_args: a second S3Hook per Content-Type cost a connection lookup and a boto3 client
        # each, 0.1 s on a quiet dev stack and three of them for every report written.
        self.hook.conn.upload_fileobj(
            io.BytesIO(data),
            bucket,
            key,
            ExtraArgs={**self.hook.extra_args, "ContentType": content_type},
            Config=self.hook.transfer_config,
        )
        return s3_uri(bucket, key)

    def write_files(
        self, bucket: str, files: Sequence[tuple[str, bytes | str, str | None]], *, workers: int = 8
    ) -> None:
        """Write several objects in parallel: ``(key, body, content_type)`` each."""
        typed = {key: (body, content_type) for key, body, content_type in files}
        self._each(
            lambda key: self.write(bucket, key, typed[key][0], content_type=typed[key][1]),
            list(typed),
            workers,
        )

    def write_json(self, bucket: str, key: str, document: Any) -> str:
        """Write ``document`` as indented JSON; return its URI."""
        return self.write(bucket, key, (json.dumps(document, indent=2, default=str) + "\n").encode())

    def copy(self, source_bucket: str, source_key: str, bucket: str, key: str) -> str:
        """Copy an object (S3 CopyObject: up to 5 GiB); return the copy's URI."""
        self.hook.copy_object(
            source_bucket_key=source_key,
            dest_bucket_key=key,
            source_bucket_name=source_bucket,
            dest_bucket_name=bucket,
        )
        return s3_uri(bucket, key)

    def delete(self, bucket: str, keys: Sequence[str]) -> None:
        """Delete the objects at ``keys``."""
        self.hook.delete_objects(bucket, list(keys))

    def list(self, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
        """Objects under ``prefix``: ``{"Key", "Size", "ETag", ...}`` each, in key order."""
        yield from self.hook.iter_file_metadata(prefix, bucket_name=bucket)

    def list_keys(
        self, bucket: str, prefix: str, *, start_after: str | None = None, max_keys: int | None = None
    ) -> builtins.list[str]:  # `list` is the method above here
        """Keys under ``prefix`` in key order, after ``start_after``, at most ``max_keys`` (one request per 1000)."""
        return self.hook.list_keys(
            bucket_name=bucket, prefix=prefix, start_after_key=start_after, max_items=max_keys, page_size=1000
        )

    def list_prefixes(self, bucket: str, prefix: str) -> builtins.list[str]:
        """The "folders" right below ``prefix`` (with their trailing '/')."""
        return self.hook.list_prefixes(bucket_name=bucket, prefix=prefix, delimiter="/") or []

    def sha256(self, bucket: str, key: str) -> str:
        """SHA-256 of an object, read in 1 MiB chunks."""
        digest = hashlib.sha256()
        for chunk in self.hook.get_key(key, bucket).get()["Body"].iter_chunks(1 << 20):
            digest.update(chunk)
        return digest.hexdigest()
