"""After training: verify the sidecar's final sync pass, promote the model, prune old checkpoints."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from kubetrain.s3_layout import (
    RunLocation,
    S3Layout,
    check_name,
    model_version,
    run_from_context,
    s3_uri,
    utc_stamp,
)

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from airflow.sdk import Context

PASS_KIND = "kubetrain/sync-pass"
POINTER_KIND = "kubetrain/model-pointer"
PROMOTE_CHOICES = ("always", "if_better", "never")
MAX_LISTED_PROBLEMS = 20
# A TensorFlow checkpoint prefix ("ckpt-12" of ckpt-12.index, ckpt-12.data-00000-of-00001) or a
# numbered Keras file ("epoch-0003" of epoch-0003.weights.h5): family name, step, rest.
_CHECKPOINT = re.compile(r"^(?P<dir>(?:.*/)?)(?P<family>[^/]*?)[-_](?P<step>\d+)(?P<rest>(?:\.[^/]*)?)$")


class SyncVerificationError(RuntimeError):
    """The run's checkpoints/output in S3 are not what the final sync pass promised."""


def checkpoint_group(path: str) -> tuple[tuple[str, str], int] | None:
    """``((directory, family), step)`` of a checkpoint file path, or ``None`` for other files."""
    match = _CHECKPOINT.match(path)
    if not match:
        return None
    return (match.group("dir"), match.group("family")), int(match.group("step"))


def parse_bool(name: str, value: Any) -> bool:
    """Accept a bool or its rendered template form ("True", "false", "1", "0")."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: expected true or false")


def _is_missing(exc: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in (
        "404",
        "NoSuchKey",
        "NotFound",
    )


def newest_pass(client: Any, run: RunLocation) -> tuple[int, str, dict[str, Any]] | None:
    """The newest sync pass manifest of a run: ``(number, key, document)``, or ``None``."""
    newest: tuple[int, str] | None = None
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=run.bucket, Prefix=run.area_prefix("sync")):
        for item in page.get("Contents", []):
            number = RunLocation.pass_number(item["Key"])
            if number is not None and (newest is None or number > newest[0]):
                newest = (number, item["Key"])
    if newest is None:
        return None
    body = client.get_object(Bucket=run.bucket, Key=newest[1])["Body"].read()
    try:
        document = json.loads(body)
    except json.JSONDecodeError as exc:
        raise SyncVerificationError(f"{s3_uri(run.bucket, newest[1])} is not JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("kind") != PASS_KIND:
        kind = document.get("kind") if isinstance(document, dict) else type(document).__name__
        raise SyncVerificationError(
            f"{s3_uri(run.bucket, newest[1])} has unknown kind {kind!r}: expected {PASS_KIND!r}"
        )
    if document.get("format_version") != 1:
        raise SyncVerificationError(
            f"{s3_uri(run.bucket, newest[1])} has unknown format_version {document.get('format_version')!r}: this version reads 1"
        )
    return newest[0], newest[1], document


def verify_files(
    client: Any, run: RunLocation, files: list[dict[str, Any]], *, checksums: bool = True
) -> list[str]:
    """Check that every listed file is in S3 with its size (and SHA-256); return the problems found.

    The SHA-256 is taken from the object's ``x-amz-meta-sha256`` metadata when the uploader set
    it, else computed by reading the object.
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
        try:
            head = client.head_object(Bucket=run.bucket, Key=key)
        except Exception as exc:
            if not _is_missing(exc):
                raise
            problems.append(f"{where}: missing from {s3_uri(run.bucket, key)}")
            continue
        if head["ContentLength"] != entry.get("size"):
            problems.append(
                f"{where}: size in S3 is {head['ContentLength']}, the manifest says {entry.get('size')}"
            )
            continue
        if not checksums or not entry.get("sha256"):
            continue
        actual = (head.get("Metadata") or {}).get("sha256")
        if not actual:
            digest = hashlib.sha256()
            for chunk in client.get_object(Bucket=run.bucket, Key=key)["Body"].iter_chunks(1 << 20):
                digest.update(chunk)
            actual = digest.hexdigest()
        if actual != entry["sha256"]:
            problems.append(f"{where}: sha256 in S3 is {actual}, the manifest says {entry['sha256']}")
    return problems


def check_final_pass(
    client: Any, run: RunLocation, *, checksums: bool = True
) -> tuple[int, str, dict[str, Any]]:
    """Return the newest pass when it is final, complete and matches S3; raise naming what is wrong."""
    found = newest_pass(client, run)
    if found is None:
        raise SyncVerificationError(
            f"no sync pass manifest under {s3_uri(run.bucket, run.area_prefix('sync'))}: the checkpoint-sync "
            "sidecar never finished a pass for this run"
        )
    number, key, document = found
    uri = s3_uri(run.bucket, key)
    if not document.get("final"):
        raise SyncVerificationError(
            f"the newest sync pass {uri} (pass {number}) is not final: the sidecar did not finish its "
            "shutdown pass, so the newest checkpoints and output may be missing"
        )
    if not document.get("complete") or document.get("errors"):
        errors = "; ".join(
            f"{e.get('area')}/{e.get('path')}: {e.get('error')}" for e in document.get("errors") or []
        )
        raise SyncVerificationError(
            f"the final sync pass {uri} is incomplete: {errors or 'complete is false'}"
        )
    problems = verify_files(client, run, list(document.get("files") or []), checksums=checksums)
    if problems:
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = f" (and {len(problems) - len(shown)} more)" if len(problems) > len(shown) else ""
        raise SyncVerificationError(
            f"S3 does not match the final sync pass {uri}: {len(problems)} problem(s){more}:\n  "
            + "\n  ".join(shown)
        )
    return number, key, document


def promote_model(
    client: Any,
    run: RunLocation,
    layout: S3Layout,
    *,
    model: str,
    version: str,
    files: list[dict[str, Any]],
    sync_pass: int,
) -> dict[str, Any]:
    """Copy the run's output files to ``models/<model>/<version>/`` and then point ``latest`` at it.

    The pointer is written last, so a reader of ``latest`` never sees a half-copied version.
    """
    outputs = [f for f in files if f.get("area") == "output"]
    if not outputs:
        raise SyncVerificationError(
            f"the final sync pass of {run.uri} lists no output files: there is no model to promote"
        )
    prefix = layout.model_prefix(model, version)
    bucket = layout.training_bucket
    for entry in outputs:
        client.copy({"Bucket": run.bucket, "Key": entry["key"]}, bucket, prefix + entry["path"])
    pointer = {
        "kind": POINTER_KIND,
        "format_version": 1,
        "model": model,
        "version": version,
        "uri": s3_uri(bucket, prefix),
        "run_uri": run.uri,
        "sync_pass": sync_pass,
        "files": sorted(entry["path"] for entry in outputs),
        "promoted_at": utc_stamp(),
    }
    client.put_object(
        Bucket=bucket,
        Key=layout.model_latest_key(model),
        Body=(json.dumps(pointer, indent=2) + "\n").encode(),
        ContentType="application/json",
    )
    return pointer


def prune_checkpoints(
    client: Any, run: RunLocation, files: list[dict[str, Any]], keep: int
) -> tuple[list[str], list[dict[str, Any]]]:
    """Delete checkpoints beyond the newest ``keep`` prefixes of each family.

    The newest prefixes are those the final pass lists; for them, exactly the listed files are
    kept. Objects of older prefixes (uploaded in earlier passes and since deleted in the pod)
    go. Files that are not numbered checkpoints (TensorFlow's ``checkpoint`` state file) stay.

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

    doomed = []
    prefix = run.area_prefix("checkpoints")
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=run.bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            if not keep_object(item["Key"][len(prefix) :], item["Key"]):
                doomed.append(item["Key"])
    for start in range(0, len(doomed), 1000):
        batch = doomed[start : start + 1000]
        response = client.delete_objects(
            Bucket=run.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
        )
        if response.get("Errors"):
            first = response["Errors"][0]
            raise RuntimeError(
                f"could not delete {first.get('Key')} while pruning {run.uri}: {first.get('Message')}"
            )
    gone = set(doomed)
    return doomed, [entry for entry in files if entry["key"] not in gone]


class SyncCheckpointsOperator(BaseOperator):
    """Verify a run's final checkpoint-sync pass, promote its model and prune old checkpoints.

    Fails, naming the problem, when the newest ``sync/pass-*.json`` of the run is missing, not
    final, incomplete, or lists a file that is not in S3 with its size and SHA-256. Then, as
    ``promote`` says, copies the output files to ``models/<model>/<version>/`` and writes the
    ``models/<model>/latest`` pointer last. Finally it deletes all but the newest
    ``keep_checkpoints`` checkpoint prefixes and, when that removed files the final pass lists,
    records the pruned set as the next pass, so the newest manifest always matches S3.

    Returns (XCom) ``{"run_uri", "sync_pass", "files", "bytes", "promoted", "model_uri",
    "model_version", "pruned"}``.

    :param model: model name under ``models/``. (templated)
    :param promote: ``"always"``, ``"if_better"`` (needs ``is_better``) or ``"never"``. (templated)
    :param is_better: the ReportOperator's ``better_than_promoted``, e.g.
        ``report.output["better_than_promoted"]``. (templated)
    :param model_version: version to promote as (default: the DAG run's time and a hash of the run URI). (templated)
    :param keep_checkpoints: checkpoint prefixes to keep per family; ``None`` keeps all. (templated)
    :param verify_checksums: also compare SHA-256 (reads objects that carry no sha256 metadata).
    :param final_pass_timeout: seconds to wait for the sidecar's final pass to land after the pod ends.
    :param run_uri: the run (default: this DAG run's prefix; see TrainingPodOperator). (templated)
    :param trial: sweep trial, as given to the TrainingPodOperator. (templated)
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: Airflow connection for S3.
    """

    template_fields: Sequence[str] = (
        "model",
        "promote",
        "is_better",
        "model_version",
        "keep_checkpoints",
        "run_uri",
        "trial",
        "training_bucket",
    )
    ui_color = "#eef7e8"

    def __init__(
        self,
        *,
        model: str,
        promote: str = "always",
        is_better: bool | str | None = None,
        model_version: str | None = None,
        keep_checkpoints: int | str | None = 3,
        verify_checksums: bool = True,
        final_pass_timeout: int = 120,
        run_uri: str | None = None,
        trial: str | None = None,
        training_bucket: str | None = None,
        aws_conn_id: str | None = "aws_default",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.final_pass_timeout = final_pass_timeout
        self.model = model
        self.promote = promote
        self.is_better = is_better
        self.model_version = model_version
        self.keep_checkpoints = keep_checkpoints
        self.verify_checksums = verify_checksums
        self.run_uri = run_uri
        self.trial = trial
        self.training_bucket = training_bucket
        self.aws_conn_id = aws_conn_id

    @cached_property
    def hook(self) -> S3Hook:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    def _settings(self) -> tuple[bool | None, int | None]:
        check_name("model", self.model)
        if self.promote not in PROMOTE_CHOICES:
            raise ValueError(
                f"promote={self.promote!r} is not valid: expected one of {', '.join(PROMOTE_CHOICES)}"
            )
        decision: bool | None = self.promote == "always"
        if self.promote == "if_better":
            # A Jinja-rendered None (the report compared nothing) counts as missing.
            if self.is_better in (None, "", "None"):
                raise ValueError(
                    "promote='if_better' needs is_better, e.g. is_better=report.output['better_than_promoted']"
                )
            decision = parse_bool("is_better", self.is_better)
        keep = self.keep_checkpoints
        if keep not in (None, ""):
            try:
                keep = int(keep)
            except (TypeError, ValueError):
                keep = -1
            if keep < 0:
                raise ValueError(
                    f"keep_checkpoints={self.keep_checkpoints!r} is not valid: expected an integer >= 0 or None"
                )
        else:
            keep = None
        return decision, keep

    def _await_final_pass(self, client: Any, run: RunLocation) -> tuple[int, str, dict[str, Any]]:
        """The verified final pass; the sidecar may still be writing it when the training task ends.

        The base container's end ends the training task, while the pod's sidecar only then gets
        its SIGTERM and runs the final pass: wait up to ``final_pass_timeout`` seconds for it.
        """
        deadline = time.monotonic() + float(self.final_pass_timeout)
        while True:
            try:
                return check_final_pass(client, run, checksums=self.verify_checksums)
            except SyncVerificationError as exc:
                if "is not final" not in str(exc) and "no sync pass manifest" not in str(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise
                self.log.info("Waiting for the sidecar's final sync pass: %s", exc)
                time.sleep(2)

    def execute(self, context: Context) -> dict[str, Any]:
        promote, keep = self._settings()
        client = self.hook.get_conn()
        layout = S3Layout.from_environment(training_bucket=self.training_bucket)
        run = run_from_context(
            context, run_uri=self.run_uri, trial=self.trial, training_bucket=self.training_bucket
        )

        number, key, document = self._await_final_pass(client, run)
        files = list(document.get("files") or [])
        self.log.info("Final sync pass %s verified: %d files", s3_uri(run.bucket, key), len(files))

        result: dict[str, Any] = {
            "run_uri": run.uri,
            "sync_pass": number,
            "files": len(files),
            "bytes": sum(int(f.get("size") or 0) for f in files),
            "promoted": False,
            "model_uri": None,
            "model_version": None,
            "pruned": 0,
        }
        if promote:
            version = self.model_version or model_version(run, _run_time(context))
            pointer = promote_model(
                client, run, layout, model=self.model, version=version, files=files, sync_pass=number
            )
            self.log.info("Promoted %s as %s (latest)", run.uri, pointer["uri"])
            result.update(promoted=True, model_uri=pointer["uri"], model_version=version)
        else:
            self.log.info(
                "Not promoting %s (promote=%s, is_better=%s)", run.uri, self.promote, self.is_better
            )

        if keep is not None:
            deleted, remaining = prune_checkpoints(client, run, files, keep)
            result["pruned"] = len(deleted)
            self.log.info("Pruned %d checkpoint objects, keeping the newest %d prefixes", len(deleted), keep)
            if len(remaining) != len(files):
                self._record_pruned_pass(client, run, document, number + 1, remaining, context)
                result["sync_pass"] = number + 1
        return result

    def _record_pruned_pass(
        self,
        client: Any,
        run: RunLocation,
        previous: dict[str, Any],
        number: int,
        files: list[dict[str, Any]],
        context: Context,
    ) -> None:
        # Readers trust only the newest pass; after pruning it must list what is really there.
        now = utc_stamp()
        document = {
            **previous,
            "pass": number,
            "final": True,
            "complete": True,
            "started_at": now,
            "finished_at": now,
            "pod": f"airflow:{self.dag_id}/{self.task_id}",
            "files": files,
            "errors": [],
        }
        client.put_object(
            Bucket=run.bucket,
            Key=run.pass_key(number),
            Body=(json.dumps(document, indent=2) + "\n").encode(),
            ContentType="application/json",
        )


def _run_time(context: Context) -> datetime:
    dag_run = context.get("dag_run")
    for name in ("run_after", "logical_date", "start_date"):
        value = getattr(dag_run, name, None)
        if value is not None:
            return value
    return datetime.now(UTC)
