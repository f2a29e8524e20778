"""The S3 reads and writes of kubetrain's Airflow side, in one place, beside the layout they follow.

:class:`RunStore` owns every object the operators read or write: staged dataset manifests,
a run's sync pass manifests and the files they list, report files, promoted models and their
``latest`` pointer, and the train-once markers. Every call goes through the S3Hook's own
methods (``head_object``, ``iter_file_metadata``, ``get_key``, ``load_bytes``,
``copy_object``, ``delete_objects``), so connection, retries, endpoint and credentials are the
amazon provider's. Report files keep their Content-Type (a browser shows them) through an
S3Hook of the same connection whose upload arguments carry it.

Failures have classes: :class:`FinalPassPending` (the sidecar is not done yet: wait) and
:class:`SyncVerificationError` (what S3 holds is not what the final pass promised: fail).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from kubetrain.s3_layout import RunLocation, S3Layout, check_name, s3_uri, safe_segment, utc_stamp

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".md": "text/markdown; charset=utf-8",
    ".png": "image/png",
}
PASS_KIND = "kubetrain/sync-pass"
POINTER_KIND = "kubetrain/model-pointer"
MAX_LISTED_PROBLEMS = 20
# S3 CopyObject, which promotion uses, copies objects up to 5 GiB.
MAX_COPY_BYTES = 5 * 1024**3
_MISSING_CODES = ("404", "NoSuchKey", "NotFound")
# A TensorFlow checkpoint prefix ("ckpt-12" of ckpt-12.index, ckpt-12.data-00000-of-00001) or a
# numbered Keras file ("epoch-0003" of epoch-0003.weights.h5): family name, step, rest.
_CHECKPOINT = re.compile(r"^(?P<dir>(?:.*/)?)(?P<family>[^/]*?)[-_](?P<step>\d+)(?P<rest>(?:\.[^/]*)?)$")


class FinalPassPending(AirflowException):
    """The run has no final sync pass yet: the checkpoint-sync sidecar has not finished its shutdown pass."""


class SyncVerificationError(AirflowFailException):
    """The run's checkpoints or output in S3 are not what its final sync pass promised; not retried."""


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


def checkpoint_group(path: str) -> tuple[tuple[str, str], int] | None:
    """``((directory, family), step)`` of a checkpoint file path, or ``None`` for other files."""
    match = _CHECKPOINT.match(path)
    if not match:
        return None
    return (match.group("dir"), match.group("family")), int(match.group("step"))


@dataclass(frozen=True)
class SyncPass:
    """One sync pass manifest of a run, as read from S3."""

    number: int
    uri: str
    document: dict[str, Any]

    @property
    def files(self) -> list[dict[str, Any]]:
        return list(self.document.get("files") or [])

    @property
    def final(self) -> bool:
        return bool(self.document.get("final"))


class RunStore:
    """kubetrain's objects in S3, read and written through one S3Hook.

    :param hook: the amazon provider's S3 hook (the operators' cached ``hook``).
    :param layout: bucket names and key scheme.
    """

    def __init__(self, hook: S3Hook, layout: S3Layout) -> None:
        self.hook = hook
        self.layout = layout
        self._typed_hooks: dict[str, S3Hook] = {}

    # -- objects -------------------------------------------------------------------------------

    def head(self, bucket: str, key: str) -> dict[str, Any] | None:
        """The object's metadata (``ContentLength``, ``ETag``, ``Metadata``), or ``None`` when it is missing."""
        return self.hook.head_object(key, bucket)

    def read(self, bucket: str, key: str) -> bytes | None:
        """The object's bytes, or ``None`` when it is missing."""
        try:
            return self.hook.get_key(key, bucket).get()["Body"].read()
        except Exception as exc:
            if is_missing_key(exc):
                return None
            raise

    def read_json(self, bucket: str, key: str) -> Any | None:
        """The object decoded as JSON, or ``None`` when it is missing; a broken document is named in the error."""
        body = self.read(bucket, key)
        if body is None:
            return None
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{s3_uri(bucket, key)} is not valid JSON: {exc}") from exc

    def write(self, bucket: str, key: str, body: bytes | str, *, content_type: str | None = None) -> str:
        """Write (or replace) an object; return its URI.

        :param content_type: the object's Content-Type (default: S3's, ``binary/octet-stream``).
        """
        data = body.encode() if isinstance(body, str) else body
        hook = self._hook_for(content_type) if content_type else self.hook
        hook.load_bytes(data, key=key, bucket_name=bucket, replace=True)
        return s3_uri(bucket, key)

    def _hook_for(self, content_type: str) -> S3Hook:
        # S3Hook's uploads take their ExtraArgs from the hook: one hook per Content-Type.
        if content_type not in self._typed_hooks:
            self._typed_hooks[content_type] = type(self.hook)(
                aws_conn_id=self.hook.aws_conn_id,
                extra_args={**self.hook.extra_args, "ContentType": content_type},
            )
        return self._typed_hooks[content_type]

    def write_json(self, bucket: str, key: str, document: Any) -> str:
        return self.write(bucket, key, (json.dumps(document, indent=2, default=str) + "\n").encode())

    def list(self, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
        """Objects under ``prefix``: ``{"Key", "Size", "ETag", ...}`` each, in key order."""
        yield from self.hook.iter_file_metadata(prefix, bucket_name=bucket)

    def sha256(self, bucket: str, key: str) -> str:
        """SHA-256 of an object, read in 1 MiB chunks."""
        digest = hashlib.sha256()
        for chunk in self.hook.get_key(key, bucket).get()["Body"].iter_chunks(1 << 20):
            digest.update(chunk)
        return digest.hexdigest()

    # -- sync passes -----------------------------------------------------------------------------

    def newest_pass(self, run: RunLocation) -> SyncPass | None:
        """The run's newest sync pass manifest, or ``None`` when the sidecar has written none."""
        newest: tuple[int, str] | None = None
        for item in self.list(run.bucket, run.area_prefix("sync")):
            number = RunLocation.pass_number(item["Key"])
            if number is not None and (newest is None or number > newest[0]):
                newest = (number, item["Key"])
        if newest is None:
            return None
        number, key = newest
        uri = s3_uri(run.bucket, key)
        try:
            document = self.read_json(run.bucket, key)
        except ValueError as exc:
            raise SyncVerificationError(str(exc)) from exc
        if not isinstance(document, dict) or document.get("kind") != PASS_KIND:
            kind = document.get("kind") if isinstance(document, dict) else type(document).__name__
            raise SyncVerificationError(f"{uri} has unknown kind {kind!r}: expected {PASS_KIND!r}")
        if document.get("format_version") != 1:
            raise SyncVerificationError(
                f"{uri} has unknown format_version {document.get('format_version')!r}: this version reads 1"
            )
        return SyncPass(number, uri, document)

    def final_pass(self, run: RunLocation, *, checksums: bool = True) -> SyncPass:
        """The run's newest pass when it is final, complete and matches S3.

        :raises FinalPassPending: no pass yet, or the newest is not final.
        :raises SyncVerificationError: the final pass is incomplete or S3 does not match it.
        """
        found = self.newest_pass(run)
        if found is None:
            raise FinalPassPending(
                f"no sync pass manifest under {s3_uri(run.bucket, run.area_prefix('sync'))}: the checkpoint-sync "
                "sidecar has not finished a pass for this run"
            )
        if not found.final:
            raise FinalPassPending(
                f"the newest sync pass {found.uri} (pass {found.number}) is not final: the sidecar has not "
                "finished its shutdown pass, so the newest checkpoints and output may be missing"
            )
        document = found.document
        if not document.get("complete") or document.get("errors"):
            errors = "; ".join(
                f"{e.get('area')}/{e.get('path')}: {e.get('error')}" for e in document.get("errors") or []
            )
            raise SyncVerificationError(
                f"the final sync pass {found.uri} is incomplete: {errors or 'complete is false'}"
            )
        problems = self.verify_files(run, found.files, checksums=checksums)
        if problems:
            shown = problems[:MAX_LISTED_PROBLEMS]
            more = f" (and {len(problems) - len(shown)} more)" if len(problems) > len(shown) else ""
            raise SyncVerificationError(
                f"S3 does not match the final sync pass {found.uri}: {len(problems)} problem(s){more}:\n  "
                + "\n  ".join(shown)
            )
        return found

    def verify_files(
        self, run: RunLocation, files: Sequence[dict[str, Any]], *, checksums: bool = True
    ) -> list[str]:
        """Check that every listed file is in S3 with its size (and SHA-256); return the problems found.

        The SHA-256 is taken from the object's ``sha256`` metadata when the uploader set it,
        else computed by reading the object.
        """
        problems = []
        for entry in files:
            area, path, key = entry.get("area"), entry.get("path"), entry.get("key")
            where = f"{area}/{path}"
            if (
                area not in ("checkpoints", "output")
                or not isinstance(key, str)
                or not key.startswith(run.area_prefix(area))
            ):
                problems.append(
                    f"{where}: key {key!r} is not inside the run's {area} area {run.area_prefix(str(area))}"
                )
                continue
            head = self.head(run.bucket, key)
            if head is None:
                problems.append(f"{where}: missing from {s3_uri(run.bucket, key)}")
                continue
            if head["ContentLength"] != entry.get("size"):
                problems.append(
                    f"{where}: size in S3 is {head['ContentLength']}, the manifest says {entry.get('size')}"
                )
                continue
            if not checksums or not entry.get("sha256"):
                continue
            # Metadata names come back as the server keeps them: MinIO and rclone say "Sha256".
            metadata = {name.lower(): value for name, value in (head.get("Metadata") or {}).items()}
            actual = metadata.get("sha256") or self.sha256(run.bucket, key)
            if actual != entry["sha256"]:
                problems.append(f"{where}: sha256 in S3 is {actual}, the manifest says {entry['sha256']}")
        return problems

    def record_pass(
        self, run: RunLocation, previous: SyncPass, files: list[dict[str, Any]], *, writer: str
    ) -> SyncPass:
        """Write the next pass manifest, final and complete, listing ``files`` (what is in S3 after pruning).

        Readers trust only the newest pass; after pruning it must list what is really there.

        :param writer: recorded as the pass's ``pod`` (who wrote it).
        """
        now = utc_stamp()
        number = previous.number + 1
        document = {
            **previous.document,
            "pass": number,
            "final": True,
            "complete": True,
            "started_at": now,
            "finished_at": now,
            "pod": writer,
            "files": files,
            "errors": [],
        }
        uri = self.write_json(run.bucket, run.pass_key(number), document)
        return SyncPass(number, uri, document)

    # -- models ----------------------------------------------------------------------------------

    def promote(self, run: RunLocation, *, model: str, version: str, sync_pass: SyncPass) -> dict[str, Any]:
        """Copy the run's output files to ``models/<model>/<version>/``, then point ``latest`` at it.

        The pointer is written last, so a reader of ``latest`` never sees a half-copied version.
        """
        outputs = [f for f in sync_pass.files if f.get("area") == "output"]
        if not outputs:
            raise SyncVerificationError(
                f"the final sync pass of {run.uri} lists no output files: there is no model to promote"
            )
        too_big = [
            f"{f['path']} ({f.get('size')} bytes)"
            for f in outputs
            if int(f.get("size") or 0) > MAX_COPY_BYTES
        ]
        if too_big:
            raise ValueError(
                f"cannot promote {run.uri}: S3 CopyObject copies objects up to 5 GiB, and {', '.join(too_big)} "
                "is larger; split the model into smaller files"
            )
        prefix = self.layout.model_prefix(model, version)
        bucket = self.layout.training_bucket
        for entry in outputs:
            self.hook.copy_object(
                source_bucket_key=entry["key"],
                dest_bucket_key=prefix + entry["path"],
                source_bucket_name=run.bucket,
                dest_bucket_name=bucket,
            )
        pointer = {
            "kind": POINTER_KIND,
            "format_version": 1,
            "model": model,
            "version": version,
            "uri": s3_uri(bucket, prefix),
            "run_uri": run.uri,
            "sync_pass": sync_pass.number,
            "files": sorted(entry["path"] for entry in outputs),
            "promoted_at": utc_stamp(),
        }
        self.write_json(bucket, self.layout.model_latest_key(model), pointer)
        return pointer

    def promoted_metrics(self, model: str) -> tuple[str | None, dict[str, Any] | None]:
        """``(version, metrics.json)`` of the promoted version of ``model``; ``(None, None)`` if none is promoted."""
        bucket = self.layout.training_bucket
        pointer_key = self.layout.model_latest_key(check_name("model", model))
        pointer = self.read_json(bucket, pointer_key)
        if pointer is None:
            return None, None
        version = pointer.get("version") if isinstance(pointer, dict) else None
        if not isinstance(version, str) or not version:
            raise ValueError(f"{s3_uri(bucket, pointer_key)} names no version: {str(pointer)[:200]}")
        metrics = self.read_json(bucket, self.layout.model_prefix(model, version) + "metrics.json")
        return version, metrics if isinstance(metrics, dict) else {}

    def prune(
        self, run: RunLocation, files: list[dict[str, Any]], keep: int
    ) -> tuple[list[str], list[dict[str, Any]]]:
        """Delete checkpoints beyond the newest ``keep`` prefixes of each family.

        The newest prefixes are those the final pass lists; for them, exactly the listed files
        are kept. Objects of older prefixes (uploaded in earlier passes and since deleted in the
        pod) go. Files that are not numbered checkpoints (TensorFlow's ``checkpoint`` state file) stay.

        :return: the deleted keys and the pass's file list without the deleted files.
        """
        steps: dict[tuple[str, str], set[int]] = {}
        for entry in files:
            if entry.get("area") == "checkpoints" and (group := checkpoint_group(entry["path"])):
                steps.setdefault(group[0], set()).add(group[1])
        kept_steps = {family: set(sorted(found, reverse=True)[:keep]) for family, found in steps.items()}
        listed = {entry["key"] for entry in files}

        def keep_object(path: str, key: str) -> bool:
            group = checkpoint_group(path)
            if group is None:
                return True
            family, step = group
            return step in kept_steps.get(family, set()) and key in listed

        prefix = run.area_prefix("checkpoints")
        doomed = [
            item["Key"]
            for item in self.list(run.bucket, prefix)
            if not keep_object(item["Key"][len(prefix) :], item["Key"])
        ]
        if doomed:
            self.hook.delete_objects(run.bucket, doomed)
        gone = set(doomed)
        return doomed, [entry for entry in files if entry["key"] not in gone]

    # -- reports ---------------------------------------------------------------------------------

    def write_report(self, run: RunLocation, files: dict[str, bytes]) -> str:
        """Write the report files into ``<run>/report/``; return the URI of ``report.html``."""
        for name, body in files.items():
            content_type = CONTENT_TYPES.get(name[name.rfind(".") :], "application/octet-stream")
            self.write(run.bucket, run.key("report", name), body, content_type=content_type)
        return s3_uri(run.bucket, run.key("report", "report.html"))

    # -- train-once markers ----------------------------------------------------------------------

    def trained_marker(self, dag_id: str, fingerprint: str) -> dict[str, Any] | None:
        """The record of a finished training with this fingerprint, or ``None``."""
        record = self.read_json(
            self.layout.training_bucket, self.layout.trained_marker_key(dag_id, fingerprint)
        )
        return record if isinstance(record, dict) else None

    def marker_uri(self, dag_id: str, fingerprint: str) -> str:
        return s3_uri(self.layout.training_bucket, self.layout.trained_marker_key(dag_id, fingerprint))

    def record_trained(self, dag_id: str, fingerprint: str, record: dict[str, Any]) -> str:
        """Write the train-once marker; return its URI."""
        return self.write_json(
            self.layout.training_bucket, self.layout.trained_marker_key(dag_id, fingerprint), record
        )

    # -- dataset manifests -----------------------------------------------------------------------

    def staged_manifest(self, dataset: str, version: str) -> dict[str, Any] | None:
        """The staged manifest of a dataset version, checked, or ``None`` when it is not staged."""
        from kubetrain.manifest import check_manifest

        bucket, key = self.layout.training_bucket, self.layout.manifest_key(dataset, version)
        document = self.read_json(bucket, key)
        if document is None:
            return None
        # The key is derived from the content, so an existing object is the same snapshot; it
        # is still checked to refuse a foreign or corrupt file under our name.
        try:
            return check_manifest(document)
        except ValueError as exc:
            raise ValueError(
                f"{s3_uri(bucket, key)} exists but is not a valid dataset manifest: {exc}"
            ) from exc

    def stage_manifest(self, manifest: dict[str, Any]) -> str:
        """Write a dataset manifest under its dataset and version; return its URI."""
        from kubetrain.manifest import dumps

        key = self.layout.manifest_key(manifest["dataset"], manifest["version"])
        return self.write(self.layout.training_bucket, key, dumps(manifest))

    # -- run records, their indexes and the promotion history ----------------------------------------

    def read_many(self, bucket: str, keys: Sequence[str], *, workers: int = 16) -> list[Any | None]:
        """The JSON documents at ``keys``, read in parallel, in the order given (``None`` where missing).

        Uses the hook's boto3 client (``hook.conn``), which threads may share (boto3 resources,
        which ``get_key`` uses, may not).
        """
        from concurrent.futures import ThreadPoolExecutor

        if not keys:
            return []
        client = self.hook.conn

        def one(key: str) -> Any | None:
            try:
                body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            except Exception as exc:
                if is_missing_key(exc):
                    return None
                raise
            try:
                return json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{s3_uri(bucket, key)} is not valid JSON: {exc}") from exc

        # no more threads than the client keeps connections (botocore's max_pool_connections, 10 by default)
        pool_size = getattr(client.meta.config, "max_pool_connections", None) or 10
        with ThreadPoolExecutor(max_workers=max(1, min(workers, pool_size, len(keys)))) as pool:
            return list(pool.map(one, keys))

    def list_keys(
        self, bucket: str, prefix: str, *, start_after: str | None = None, max_keys: int | None = None
    ) -> list[str]:
        """Keys under ``prefix`` in key order, after ``start_after``, at most ``max_keys`` (one request per 1000)."""
        return self.hook.list_keys(
            bucket_name=bucket, prefix=prefix, start_after_key=start_after, max_items=max_keys, page_size=1000
        )

    def list_prefixes(self, bucket: str, prefix: str) -> list[str]:
        """The "folders" right below ``prefix`` (with their trailing '/')."""
        return self.hook.list_prefixes(bucket_name=bucket, prefix=prefix, delimiter="/") or []

    def run_record(self, run: RunLocation) -> dict[str, Any] | None:
        """The record of a run, or ``None`` when it has none."""
        record = self.read_json(run.bucket, self.layout.run_record_key(run))
        return record if isinstance(record, dict) else None

    def write_run_record(self, record: dict[str, Any]) -> str:
        """Write a run record and its index copies; return the record's URI.

        Writing the same run again (a retried record step, a cleared and re-run DAG run) replaces
        its index entries: the copies of the previous record under other names (another status,
        value or dataset version) are deleted after the new ones are written, so the run is
        never missing from the indexes and never listed twice.
        """
        from kubetrain.run_record import check_document, record_keys

        check_document(record)
        run = RunLocation.from_uri(record["run_uri"])
        bucket = self.layout.training_bucket
        if run.bucket != bucket:
            raise ValueError(
                f"run {run.uri} is not in the training bucket {bucket}: its record would not be indexed"
            )
        previous = self.run_record(run)
        keys = record_keys(self.layout, record)
        body = (json.dumps(record, indent=1, sort_keys=False) + "\n").encode()
        # The run's own key last: a reader of the previous record still finds its stale copies to delete.
        for key in [*keys[1:], keys[0]]:
            self.write(bucket, key, body, content_type="application/json")
        if previous is not None:
            try:
                stale = set(record_keys(self.layout, previous)) - set(keys)
            except (KeyError, ValueError, TypeError):
                stale = set()  # a record of an older format: its copies cannot be named
            if stale:
                self.hook.delete_objects(bucket, sorted(stale))
        return s3_uri(bucket, keys[0])

    def record_promotion(self, event: dict[str, Any]) -> str:
        """Append a promotion to its model's history; return its URI."""
        from kubetrain.run_record import check_document, promotion_name

        check_document(event, "promotion")
        key = self.layout.promotions_prefix(event["model"]) + promotion_name(event, written=datetime.now(UTC))
        return self.write(
            self.layout.training_bucket,
            key,
            json.dumps(event, indent=1) + "\n",
            content_type="application/json",
        )

    def promotions(self, model: str, *, limit: int = 50) -> list[dict[str, Any]]:
        """The newest ``limit`` promotions of ``model``, newest first."""
        bucket = self.layout.training_bucket
        keys = self.list_keys(bucket, self.layout.promotions_prefix(model), max_keys=limit)
        return [doc for doc in self.read_many(bucket, keys) if isinstance(doc, dict)]

    def has_promotion(self, model: str, version: str, *, newest: int = 100) -> bool:
        """Whether one of the newest ``newest`` promotions of ``model`` is of ``version``."""
        from kubetrain.run_record import SEPARATOR

        suffix = f"{SEPARATOR}{safe_segment(version)}.json"
        keys = self.list_keys(
            self.layout.training_bucket, self.layout.promotions_prefix(model), max_keys=newest
        )
        return any(key.endswith(suffix) for key in keys)

    def promoted_pointer(self, model: str) -> dict[str, Any] | None:
        """The ``models/<model>/latest`` pointer, or ``None`` when nothing is promoted."""
        pointer = self.read_json(
            self.layout.training_bucket, self.layout.model_latest_key(check_name("model", model))
        )
        return pointer if isinstance(pointer, dict) else None

    def resumed_from_step(self, run: RunLocation) -> int | None:
        """The step the run's last pod resumed from, from its sync pass manifests; 0 when it started fresh.

        For containers that do not say so in metrics.json. Pass numbers continue across the pods
        of a run and pods follow each other, so the last pod's first pass is found by a binary
        search over the pass manifests (a few reads, however long the run); the pass before it
        is what that pod restored, and its newest checkpoint is the step it resumed from.
        ``None`` when the run has no pass manifests, or the previous pod's last pass lists no
        numbered checkpoint.
        """
        numbers = sorted(
            n
            for item in self.list(run.bucket, run.area_prefix("sync"))
            if (n := RunLocation.pass_number(item["Key"])) is not None
        )
        if not numbers:
            return None
        pods: dict[int, str] = {}

        def pod(index: int) -> str:
            if index not in pods:
                document = self.read_json(run.bucket, run.pass_key(numbers[index]))
                pods[index] = str((document or {}).get("pod") or "") if isinstance(document, dict) else ""
            return pods[index]

        last = len(numbers) - 1
        while last > 0 and pod(last).startswith("airflow:"):  # passes the promote step rewrote after pruning
            last -= 1
        trainer_pod = pod(last)
        low, high = 0, last
        while low < high:
            middle = (low + high) // 2
            if pod(middle) == trainer_pod:
                high = middle
            else:
                low = middle + 1
        if low == 0:
            return 0
        before = self.read_json(run.bucket, run.pass_key(numbers[low - 1]))
        steps = [
            group[1]
            for entry in (before or {}).get("files") or []
            if entry.get("area") == "checkpoints" and (group := checkpoint_group(str(entry.get("path"))))
        ]
        return max(steps) if steps else None
