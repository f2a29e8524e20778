"""After training: verify the sidecar's final sync pass, promote the model, prune old checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from kubetrain.operators.base import RunOperator
from kubetrain.run_store import FinalPassPending, SyncPass, SyncVerificationError, parse_bool
from kubetrain.s3_layout import RunLocation, check_name, model_version
from kubetrain.triggers.sync import FinalSyncPassTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context

PROMOTE_CHOICES = ("always", "if_better", "never")


class PromoteModelOperator(RunOperator):
    """Verify a run's final checkpoint-sync pass, promote its model and prune old checkpoints.

    Fails, naming the problem, when the newest ``sync/pass-*.json`` of the run is incomplete
    or lists a file that is not in S3 with its size and SHA-256. When the sidecar's final pass
    has not landed yet (it runs as the pod shuts down), the task defers to a
    :class:`~kubetrain.triggers.sync.FinalSyncPassTrigger` instead of waiting in its worker slot.
    Then, as ``promote`` says, it copies the output files to ``models/<model>/<version>/`` and
    writes the ``models/<model>/latest`` pointer last. Finally it deletes all but the newest
    ``keep_checkpoints`` checkpoint prefixes and, when that removed files the final pass lists,
    records the pruned set as the next pass, so the newest manifest always matches S3.

    Each promotion is appended to the model's history (``promotions/<model>/``: when, which
    run, by which rule and why), which the Training page shows.

    The run's report, written before this task (its comparison decides ``if_better``), then gets
    the decision: promoted as which model URI and version, or why not, with this run's metric and
    the promoted model's. The report's promotion block is rendered anew and each file (report.html,
    report.md) is put whole, so a reader sees the page before or after, never half of it; a report
    without the block (none written, or one from an older release) is left as it is.

    Returns (XCom) ``{"run_uri", "sync_pass", "files", "bytes", "promoted", "model_uri",
    "model_version", "pruned"}``, and after a promotion ``"reason"`` and ``"previous_version"``;
    each key is also its own XCom.

    :param model: model name under ``models/``. (templated)
    :param promote: ``"always"``, ``"if_better"`` (needs ``is_better``) or ``"never"``. (templated)
    :param is_better: whether the run beats the promoted model: ``report.output["better_than_promoted"]``. (templated)
    :param model_version: version to promote as (default: the DAG run's time and a hash of the run URI). (templated)
    :param keep_checkpoints: checkpoint prefixes to keep per family; ``None`` keeps all. (templated)
    :param verify_checksums: also compare SHA-256 (reads objects that carry no sha256 metadata).
    :param final_pass_timeout: seconds to wait (deferred) for the sidecar's final pass to land.
    :param poll_interval: seconds between looks for it.
    :param run_uri: the run, e.g. ``train.output["run_uri"]``. (templated)
    :param trial: sweep trial, as given to the TrainingPodOperator. (templated)
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: Airflow connection for S3.
    """

    template_fields: Sequence[str] = (
        *RunOperator.template_fields,
        "model",
        "promote",
        "is_better",
        "model_version",
        "keep_checkpoints",
    )
    ui_color = "#eef7e8"

    def __init__(
        self,
        *,
        model: str,
        promote: str = "always",
        is_better: bool | None = None,
        model_version: str | None = None,
        keep_checkpoints: int | str | None = 3,
        verify_checksums: bool = True,
        final_pass_timeout: float = 300,
        poll_interval: float = 2,
        multiple_outputs: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(multiple_outputs=multiple_outputs, **kwargs)
        self.model = model
        self.promote = promote
        self.is_better = is_better
        self.model_version = model_version
        self.keep_checkpoints = keep_checkpoints
        self.verify_checksums = verify_checksums
        self.final_pass_timeout = final_pass_timeout
        self.poll_interval = poll_interval

    def decisions(self) -> tuple[bool, int | None]:
        """``(promote?, checkpoint prefixes to keep)``, checked before anything is touched."""
        check_name("model", self.model)
        if self.promote not in PROMOTE_CHOICES:
            raise ValueError(
                f"promote={self.promote!r} is not valid: expected one of {', '.join(PROMOTE_CHOICES)}"
            )
        promote = self.promote == "always"
        if self.promote == "if_better":
            if self.is_better is None:
                raise ValueError(
                    "promote='if_better' needs is_better, e.g. is_better=report.output['better_than_promoted'] "
                    "(the report compared nothing: did the run write metrics.json?)"
                )
            promote = parse_bool("is_better", self.is_better)
        keep = self.keep_checkpoints
        if keep in (None, ""):
            return promote, None
        try:
            keep = int(keep)
        except (TypeError, ValueError):
            keep = -1
        if keep < 0:
            raise ValueError(
                f"keep_checkpoints={self.keep_checkpoints!r} is not valid: expected an integer >= 0 or None"
            )
        return promote, keep

    def execute(self, context: Context) -> dict[str, Any]:
        self.decisions()
        run = self.run_location(context)
        try:
            final = self.store.passes.final(run, checksums=self.verify_checksums)
        except FinalPassPending as exc:
            if self.final_pass_timeout <= 0:
                raise
            self.log.info("Waiting, deferred, for the sidecar's final sync pass: %s", exc)
            self.defer(
                trigger=FinalSyncPassTrigger(
                    run_uri=run.uri,
                    aws_conn_id=self.aws_conn_id,
                    timeout=self.final_pass_timeout,
                    poll_interval=self.poll_interval,
                ),
                method_name="execute_complete",
                timeout=timedelta(seconds=self.final_pass_timeout + 60),
            )
        return self.finish(context, run, final)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume when the final pass has landed (or the wait ended without it)."""
        run = self.run_location(context)
        if event.get("status") != "final":
            raise SyncVerificationError(event.get("message") or f"no final sync pass for {run.uri}: {event}")
        try:
            final = self.store.passes.final(run, checksums=self.verify_checksums)
        except FinalPassPending as exc:  # a newer, unfinished pass appeared: another pod writes here
            raise SyncVerificationError(f"{exc} (after a final pass had landed)") from exc
        return self.finish(context, run, final)

    def finish(self, context: Context, run: RunLocation, final: SyncPass) -> dict[str, Any]:
        promote, keep = self.decisions()
        files = final.files
        self.log.info("Final sync pass %s verified: %d files", final.uri, len(files))
        result: dict[str, Any] = {
            "run_uri": run.uri,
            "sync_pass": final.number,
            "files": len(files),
            "bytes": sum(int(f.get("size") or 0) for f in files),
            "promoted": False,
            "model_uri": None,
            "model_version": None,
            "pruned": 0,
        }
        if promote:
            version = self.model_version or model_version(run, _run_time(context))
            previous_version, previous_metrics = self.store.models.promoted_metrics(self.model)
            pointer = self.store.models.promote(run, model=self.model, version=version, sync_pass=final)
            self.log.info("Promoted %s as %s (latest)", run.uri, pointer["uri"])
            result.update(promoted=True, model_uri=pointer["uri"], model_version=version)
            result.update(self.record_promotion(context, run, pointer, previous_version, previous_metrics))
            if previous_version == version:  # a retry: the version promoted before this one is not known
                previous_version = previous_metrics = None
        else:
            self.log.info(
                "Not promoting %s (promote=%s, is_better=%s)", run.uri, self.promote, self.is_better
            )
            try:  # for the report's figures only: a broken pointer must not fail a run that promotes nothing
                previous_version, previous_metrics = self.store.models.promoted_metrics(self.model)
            except ValueError as exc:
                self.log.warning("The promoted %s cannot be read for the report: %s", self.model, exc)
                previous_version = previous_metrics = None
        self.update_report(run, result, previous_version, previous_metrics)

        if keep is not None:
            deleted, remaining = self.store.passes.prune(run, files, keep)
            result["pruned"] = len(deleted)
            self.log.info("Pruned %d checkpoint objects, keeping the newest %d prefixes", len(deleted), keep)
            if len(remaining) != len(files):
                recorded = self.store.passes.record(
                    run, final, remaining, writer=f"airflow:{self.dag_id}/{self.task_id}"
                )
                result["sync_pass"] = recorded.number
        return result

    def update_report(
        self,
        run: RunLocation,
        result: dict[str, Any],
        previous_version: str | None,
        previous_metrics: dict[str, Any] | None,
    ) -> None:
        """Write the decision into the run's report (report.html and report.md), when it has a promotion block.

        :param result: this task's result so far (``promoted``, ``model_uri``, ``model_version``).
        :param previous_version: the version promoted before this decision, and ``previous_metrics`` its
            metrics.json (``None``: none was).
        """
        from kubetrain.report.render import promotion_outcome, with_promotion

        metrics = self.store.read_json(run.bucket, run.key("output", "metrics.json"))
        metrics = metrics if isinstance(metrics, dict) else {}
        monitor, mode = metrics.get("monitor"), metrics.get("monitor_mode")

        def value_in(doc: dict[str, Any] | None) -> float | None:
            final = (doc or {}).get("final")
            value = final.get(monitor) if isinstance(final, dict) and isinstance(monitor, str) else None
            return value if isinstance(value, int | float) and not isinstance(value, bool) else None

        outcome = promotion_outcome(
            promoted=bool(result["promoted"]),
            rule=str(self.promote),
            model=self.model,
            monitor=monitor if isinstance(monitor, str) else None,
            mode=mode if isinstance(mode, str) else None,
            value=value_in(metrics),
            other_version=previous_version,
            other_value=value_in(previous_metrics),
            model_uri=result.get("model_uri"),
            version=result.get("model_version"),
        )
        files = {}
        for name, kind in (("report.md", "md"), ("report.html", "html")):
            body = self.store.read(run.bucket, run.key("report", name))
            if body is None:
                self.log.info("No %s in %s/report/: nothing to tell of the promotion", name, run.uri)
                return
            try:
                files[name] = with_promotion(body.decode("utf-8"), kind, outcome).encode("utf-8")
            except (UnicodeDecodeError, ValueError) as exc:
                self.log.warning("The report of %s is left as it is: %s", run.uri, exc)
                return
        # report.md first, report.html last: the page the links open changes once both are written
        uri = self.store.reports.write(run, files)
        self.log.info("Report %s now says: %s", uri, outcome["text"])

    def record_promotion(
        self,
        context: Context,
        run: RunLocation,
        pointer: dict[str, Any],
        previous_version: str | None,
        previous_metrics: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Append the promotion to the model's history (``promotions/<model>/``): when, which run, by which rule, why.

        Returns ``{"reason", "previous_version"}`` for the task's result.
        """
        from kubetrain.run_record import promotion_event, promotion_reason

        metrics = self.store.read_json(run.bucket, run.key("output", "metrics.json"))
        metrics = metrics if isinstance(metrics, dict) else {}
        monitor, mode = metrics.get("monitor"), metrics.get("monitor_mode")

        def value_in(doc: dict[str, Any] | None) -> Any:
            final = (doc or {}).get("final")
            return final.get(monitor) if isinstance(final, dict) and monitor else None

        value, previous_value = value_in(metrics), value_in(previous_metrics)
        again = previous_version == pointer["version"]  # a retried task promoted the same version again
        if again:
            previous_version = previous_value = None
        reason = promotion_reason(
            rule=self.promote,
            promoted=True,
            monitor=monitor,
            mode=mode,
            value=value if isinstance(value, int | float) else None,
            other_version=previous_version,
            other_value=previous_value if isinstance(previous_value, int | float) else None,
        )
        ti = context["ti"]
        event = promotion_event(
            model=self.model,
            version=pointer["version"],
            model_uri=pointer["uri"],
            dag_id=ti.dag_id,
            run_id=context["run_id"],
            trial=self.trial if self.trial not in (None, "") else _map_index(ti),
            run_uri=run.uri,
            rule=self.promote,
            reason=reason,
            monitor=monitor,
            value=value if isinstance(value, int | float) else None,
            previous_version=previous_version,
            previous_value=previous_value if isinstance(previous_value, int | float) else None,
            promoted_at=pointer.get("promoted_at"),
        )
        if again and self.store.promotions.has(self.model, pointer["version"]):
            self.log.info("Promotion history already lists version %s", pointer["version"])
        else:
            uri = self.store.promotions.record(event)
            self.log.info("Promotion history: %s (%s)", uri, reason)
        return {"reason": reason, "previous_version": previous_version}


def _map_index(ti: Any) -> str | None:
    index = getattr(ti, "map_index", -1)
    return str(index) if isinstance(index, int) and index >= 0 else None


def _run_time(context: Context) -> datetime:
    dag_run = context.get("dag_run")
    for name in ("run_after", "logical_date", "start_date"):
        value = getattr(dag_run, name, None)
        if value is not None:
            return value
    return datetime.now(UTC)
