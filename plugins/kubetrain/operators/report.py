"""Report on a training run: plots, HTML and Markdown in S3, and a comparison with the promoted model."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from kubetrain.links import REPORT_URL_XCOM_KEY, ReportLink, report_url
from kubetrain.report.inputs import (
    ReportInputs,
    compare,
    parse_confusion,
    parse_history,
    parse_json,
    parse_metrics,
    parse_samples,
)
from kubetrain.s3_layout import RunLocation, S3Layout, check_name, run_from_context, s3_uri

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from airflow.sdk import Context

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".md": "text/markdown; charset=utf-8",
    ".png": "image/png",
}


def _read(client: Any, bucket: str, key: str) -> bytes | None:
    from botocore.exceptions import ClientError

    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def promoted_metrics(client: Any, layout: S3Layout, model: str) -> tuple[str | None, dict[str, Any] | None]:
    """``(version, metrics.json)`` of the promoted version of ``model``; ``(None, None)`` if none is promoted."""
    pointer_key = layout.model_latest_key(model)
    raw = _read(client, layout.training_bucket, pointer_key)
    if raw is None:
        return None, None
    pointer = parse_json(s3_uri(layout.training_bucket, pointer_key), raw)
    version = pointer.get("version") if isinstance(pointer, dict) else None
    if not isinstance(version, str) or not version:
        raise ValueError(f"{s3_uri(layout.training_bucket, pointer_key)} names no version: {raw[:200]!r}")
    metrics_raw = _read(client, layout.training_bucket, layout.model_prefix(model, version) + "metrics.json")
    metrics = parse_json("the promoted metrics.json", metrics_raw) if metrics_raw is not None else {}
    return version, metrics if isinstance(metrics, dict) else {}


class ReportOperator(BaseOperator):
    """Render a training run's report into ``<run>/report/`` and compare it with the promoted model.

    Reads ``output/metrics.json`` (required), ``history.csv``, ``params.json`` and, when
    present, ``confusion_matrix.json`` (classifiers) and ``samples.json`` (dialogue) from the
    run prefix; writes ``report.html`` (self-contained, plots inlined as PNG data URIs),
    ``report.md`` and the PNG plots. With ``model`` set, compares the run with
    ``models/<model>/latest`` on metrics.json's ``monitor`` and ``monitor_mode`` (strictly
    better wins; with nothing promoted yet, the run is better).

    Returns (XCom) a compact dict: ``run_uri``, ``report_uri``, ``report_url``, ``trainer``,
    ``monitor``, ``monitor_mode``, ``value``, ``final``, ``best``, ``epochs``, ``steps``,
    ``wall_time_s``, ``examples_per_s``, ``better_than_promoted``, ``promoted_metric``,
    ``promoted_version``. The task instance gets a "Training report" link.

    :param model: model name to compare with (``None``: no comparison). (templated)
    :param compare_on: ``"final"`` (the exported model's values) or ``"best"`` (best epoch).
    :param title: report title. (templated)
    :param run_uri: the run (default: this DAG run's prefix; see TrainingPodOperator). (templated)
    :param trial: sweep trial, as given to the TrainingPodOperator. (templated)
    :param require_metrics: fail when the run left no metrics.json (default); when false, such a
        run gets no report and no comparison. (templated)
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: Airflow connection for S3.
    """

    template_fields: Sequence[str] = ("model", "title", "run_uri", "trial", "training_bucket", "require_metrics")
    operator_extra_links = (ReportLink(),)
    ui_color = "#fdf5e6"

    def __init__(
        self,
        *,
        model: str | None = None,
        compare_on: str = "final",
        title: str | None = None,
        run_uri: str | None = None,
        trial: str | None = None,
        training_bucket: str | None = None,
        require_metrics: bool | str = True,
        aws_conn_id: str | None = "aws_default",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.require_metrics = require_metrics
        self.model = model
        self.compare_on = compare_on
        self.title = title
        self.run_uri = run_uri
        self.trial = trial
        self.training_bucket = training_bucket
        self.aws_conn_id = aws_conn_id

    @cached_property
    def hook(self) -> S3Hook:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    def load_inputs(self, client: Any, run: RunLocation) -> ReportInputs:
        """Read and check the run's output files."""

        def read(name: str) -> bytes | None:
            return _read(client, run.bucket, run.key("output", name))

        raw_metrics = read("metrics.json")
        if raw_metrics is None:
            raise FileNotFoundError(
                f"no metrics.json at {s3_uri(run.bucket, run.key('output', 'metrics.json'))}: the training "
                "container did not write OUTPUT_DIR/metrics.json, or the sync sidecar did not upload it"
            )
        inputs = ReportInputs(run_uri=run.uri, metrics=parse_metrics(raw_metrics), title=self.title)
        if (raw := read("history.csv")) is not None:
            inputs.history = parse_history(raw)
        else:
            inputs.notes.append("history.csv is missing: no curves")
        if (raw := read("params.json")) is not None:
            params = parse_json("params.json", raw)
            inputs.params = params if isinstance(params, dict) else None
        if (raw := read("confusion_matrix.json")) is not None:
            inputs.confusion = parse_confusion(raw)
        if (raw := read("samples.json")) is not None:
            inputs.samples = parse_samples(raw)
        return inputs

    def execute(self, context: Context) -> dict[str, Any]:
        from kubetrain.report.render import render_report

        if self.compare_on not in ("final", "best"):
            raise ValueError(f"compare_on={self.compare_on!r} is not valid: expected 'final' or 'best'")
        client = self.hook.get_conn()
        layout = S3Layout.from_environment(training_bucket=self.training_bucket)
        run = run_from_context(
            context, run_uri=self.run_uri, trial=self.trial, training_bucket=self.training_bucket
        )
        if str(self.require_metrics).lower() in ("false", "0", "no") and (
            _read(client, run.bucket, run.key("output", "metrics.json")) is None
        ):
            # A third-party container need not write metrics: nothing to report or compare.
            self.log.info("No metrics.json in %s/output/: no report for this run", run.uri)
            return {"run_uri": run.uri, "report_uri": None, "report_url": None, "better_than_promoted": None}
        inputs = self.load_inputs(client, run)
        metrics = inputs.metrics

        if self.model:
            version, promoted = promoted_metrics(client, layout, check_name("model", self.model))
            inputs.comparison = compare(metrics, promoted, version, on=self.compare_on)
            self.log.info("Comparison with the promoted %s: %s", self.model, inputs.comparison.reason)

        files = render_report(inputs)
        for name, body in files.items():
            content_type = CONTENT_TYPES.get(name[name.rfind(".") :], "application/octet-stream")
            client.put_object(
                Bucket=run.bucket, Key=run.key("report", name), Body=body, ContentType=content_type
            )
        report_key = run.key("report", "report.html")
        report_uri = s3_uri(run.bucket, report_key)
        url = report_url(
            run.bucket,
            report_key,
            endpoint_url=self.hook.conn_config.endpoint_url,
            region=self.hook.conn_region_name,
        )
        context["ti"].xcom_push(key=REPORT_URL_XCOM_KEY, value=url)
        self.log.info("Report written to %s (%d files): %s", report_uri, len(files), url)

        comparison = inputs.comparison
        monitor = metrics["monitor"]
        section = metrics.get(self.compare_on) if isinstance(metrics.get(self.compare_on), dict) else {}
        return {
            "run_uri": run.uri,
            "report_uri": report_uri,
            "report_url": url,
            "trainer": metrics.get("trainer"),
            "monitor": monitor,
            "monitor_mode": metrics["monitor_mode"],
            "value": section.get(monitor),
            "final": metrics["final"],
            "best": metrics.get("best"),
            "epochs": metrics.get("epochs"),
            "steps": metrics.get("steps"),
            "wall_time_s": metrics.get("wall_time_s"),
            "examples_per_s": metrics.get("examples_per_s"),
            "better_than_promoted": comparison.better if comparison else None,
            "promoted_metric": comparison.promoted_value if comparison else None,
            "promoted_version": comparison.promoted_version if comparison else None,
        }
