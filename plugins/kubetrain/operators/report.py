"""Report on a training run: plots, HTML and Markdown in S3, and a comparison with the promoted model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kubetrain.links import REPORT_URL_XCOM_KEY, ReportLink, airflow_run_url, report_url
from kubetrain.operators.base import RunOperator
from kubetrain.report.inputs import ReportInputs, compare, load_run_inputs, user_set_params
from kubetrain.run_store import parse_bool
from kubetrain.s3_layout import RunLocation, check_name, s3_uri

if TYPE_CHECKING:
    from airflow.sdk import Context

RESULT_KEYS = (
    "run_uri",
    "report_uri",
    "report_url",
    "trainer",
    "monitor",
    "monitor_mode",
    "value",
    "final",
    "best",
    "epochs",
    "steps",
    "wall_time_s",
    "examples_per_s",
    "better_than_promoted",
    "promoted_metric",
    "promoted_version",
)


def note_lines(notes: Any) -> list[str]:
    """The report's top lines from a list of strings, one string, or nothing."""
    if notes in (None, "", "None", "[]"):
        return []
    if isinstance(notes, str):
        return [notes]
    if isinstance(notes, Sequence):
        return [str(n) for n in notes if n not in (None, "")]
    raise ValueError(f"notes {notes!r} is not a list of lines: expected e.g. train.output['notes']")


def command_words(command: Any) -> list[str] | None:
    """A container command as a list of words, from a list, one string (split as a shell would), or nothing."""
    if command in (None, "", "None", "[]"):
        return None
    if isinstance(command, str):
        import shlex

        return shlex.split(command)
    if isinstance(command, Sequence):
        return [str(word) for word in command]
    raise ValueError(f"command {command!r} is not a list of words: expected e.g. ['python', 'train.py']")


def run_date(context: Context) -> str | None:
    """When the DAG run ran, in UTC to the minute: its ``run_after``, else its logical or start date."""
    from datetime import UTC

    dag_run = context.get("dag_run")
    for name in ("run_after", "logical_date", "start_date"):
        value = getattr(dag_run, name, None)
        if value is not None and hasattr(value, "astimezone"):
            return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return None


def image_revision(
    image: str | None, *, registry_conn_id: str | None = None
) -> tuple[str | None, str | None]:
    """``(revision, None)``: the git revision an image pinned by digest carries (its
    ``org.opencontainers.image.revision`` label), else ``(None, why not)``; ``(None, None)`` with no image.

    The revision is a fact the report shows, never a reason to fail it: a registry that cannot be asked
    leaves the report with the digest and a sentence that says so.

    :param image: ``<repository>@sha256:...``, e.g. ``check.output["image"]``.
    :param registry_conn_id: the registry connection.
    """
    from kubetrain.images import has_digest, image_labels
    from kubetrain.report.render import REVISION_LABEL

    if not image:
        return None, None
    if not has_digest(image):
        return None, f"the image {image} is not pinned by digest, so its labels were not read"
    try:
        labels = image_labels(image, registry_conn_id=registry_conn_id)
    except Exception as exc:  # any failure to ask (network, credentials, a registry's odd answer)
        return None, f"the registry could not be asked for the image's labels ({exc})"
    revision = labels.get(REVISION_LABEL, "").strip()
    if revision == "unknown":  # what `make images` labels outside a git checkout
        return None, f"the image's {REVISION_LABEL} label says 'unknown' (built outside a git checkout)"
    if not revision:
        return None, f"the image carries no {REVISION_LABEL} label"
    return revision, None


class ReportOperator(RunOperator):
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
    ``promoted_version``; each key is also its own XCom, for typed hand-offs such as
    ``report.output["better_than_promoted"]``. The task instance gets a "Training report" link.

    :param model: model name to compare with (``None``: no comparison). (templated)
    :param compare_on: ``"final"`` (the exported model's values) or ``"best"`` (best epoch).
    :param title: report title. (templated)
    :param run_uri: the run (default: this DAG run's prefix; see TrainingPodOperator). (templated)
    :param trial: sweep trial, as given to the TrainingPodOperator. (templated)
    :param require_metrics: fail when the run left no metrics.json (default); when false, such a
        run gets no report and no comparison. (templated)
    :param notes: lines the report shows at the top, e.g. the training task's XCom ``notes``
        (``train.output["notes"]``: a GPU request served on CPU). (templated)
    :param disruptions: the training task's preemptions and time queued, ``train.output["disruptions"]``:
        the report counts them, with the steps each preemption lost. (templated)
    :param image: the training image by digest (``check.output["image"]``), for a container that records
        none in params.json (an image of the user's own): the report's Image and Trainer rows. (templated)
    :param dataset_version: the staged dataset version (``stage.output["version"]``), likewise. (templated)
    :param command: the training container's command (the training task's ``cmds``), for the Trainer row
        of a container whose metrics.json names no ``trainer``. (templated)
    :param dataset_uri: the dataset the run trained on (``{{ params.dataset_uri }}``). (templated)
    :param dataset_bytes: its size as staged (``stage.output["total_bytes"]``). (templated)
    :param dataset_objects: its number of objects (``stage.output["objects"]``). (templated)
    :param promote: the promote task's rule when one follows this report (``{{ params.promote }}``): the
        report says the decision is pending, and the promote task writes it into the report. (templated)
    :param registry_conn_id: registry connection to read the image's labels with (the Code version row
        shows its ``org.opencontainers.image.revision``).

    The report also gives the run's date and a link to the run in the Airflow UI, and marks the
    hyperparameters this run set (its conf against the DAG's Param defaults) apart from the defaults.
    :param training_bucket: training bucket (default: the deployment's). (templated)
    :param aws_conn_id: Airflow connection for S3.
    """

    template_fields: Sequence[str] = (
        *RunOperator.template_fields,
        "model",
        "title",
        "require_metrics",
        "notes",
        "disruptions",
        "image",
        "dataset_version",
        "command",
        "dataset_uri",
        "dataset_bytes",
        "dataset_objects",
        "promote",
    )
    operator_extra_links = (ReportLink(),)
    ui_color = "#fdf5e6"

    def __init__(
        self,
        *,
        model: str | None = None,
        compare_on: str = "final",
        title: str | None = None,
        require_metrics: bool | str = True,
        notes: Sequence[str] | str | None = None,
        disruptions: Mapping[str, Any] | None = None,
        image: str | None = None,
        dataset_version: str | None = None,
        command: Sequence[str] | str | None = None,
        dataset_uri: str | None = None,
        dataset_bytes: int | str | None = None,
        dataset_objects: int | str | None = None,
        promote: str | None = None,
        registry_conn_id: str | None = None,
        multiple_outputs: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(multiple_outputs=multiple_outputs, **kwargs)
        self.dataset_uri = dataset_uri
        self.dataset_bytes = dataset_bytes
        self.dataset_objects = dataset_objects
        self.promote = promote
        self.registry_conn_id = registry_conn_id
        self.notes = notes
        self.disruptions = disruptions
        self.image = image
        self.dataset_version = dataset_version
        self.command = command
        self.require_metrics = require_metrics
        self.model = model
        self.compare_on = compare_on
        self.title = title

    def run_disruptions(self, run: RunLocation) -> Any:
        """The run's preemptions and time queued (a RunDisruptions), or None when there were none."""
        from kubetrain.run_record import disruptions_of, interrupted_pods

        if not isinstance(self.disruptions, Mapping):
            return None
        pods = interrupted_pods(self.disruptions)
        checkpoints = {}
        if pods:
            try:
                checkpoints = self.store.passes.last_checkpoints(run, pods)
            except ValueError as exc:  # a broken pass manifest: the steps lost stay unknown
                self.log.warning("Could not read the sync passes of the interrupted pods: %s", exc)
        return disruptions_of(self.disruptions, checkpoints)

    def user_set(self, context: Context) -> dict[str, tuple[Any, Any]] | None:
        """The Params this DAG run set to another value than the DAG's defaults (``None``: no DAG known)."""
        if not self.has_dag():
            return None
        params = self.dag.params
        defaults = {}
        for name in params:
            param = params.get_param(name)
            defaults[name] = param.value if param.has_value else None
        dag_run = context.get("dag_run")
        return user_set_params(getattr(dag_run, "conf", None), defaults)

    def describe_run(self, context: Context, inputs: ReportInputs) -> None:
        """What Airflow and the stage task know of the run: date, link, dataset, revision, settings."""
        inputs.run_date = run_date(context)
        inputs.airflow_url = airflow_run_url(context["ti"].dag_id, context["run_id"])
        inputs.dataset_uri = self.dataset_uri or None
        inputs.dataset_bytes = _count("dataset_bytes", self.dataset_bytes)
        inputs.dataset_objects = _count("dataset_objects", self.dataset_objects)
        inputs.promote_rule = self.promote or None
        inputs.user_set = self.user_set(context)
        inputs.revision, inputs.revision_note = image_revision(
            inputs.image, registry_conn_id=self.registry_conn_id
        )
        if inputs.revision_note:
            self.log.info("Code version: no revision (%s)", inputs.revision_note)

    def load_inputs(self, run: RunLocation) -> ReportInputs:
        """Read and check the run's output files."""

        def read(name: str) -> bytes | None:
            return self.store.read(run.bucket, run.key("output", name))

        inputs = load_run_inputs(read, run.uri, title=self.title)
        if inputs is None:
            raise FileNotFoundError(
                f"no metrics.json at {s3_uri(run.bucket, run.key('output', 'metrics.json'))}: the training "
                "container did not write OUTPUT_DIR/metrics.json, or the sync sidecar did not upload it"
            )
        return inputs

    def execute(self, context: Context) -> dict[str, Any]:
        from kubetrain.report.render import render_report

        if self.compare_on not in ("final", "best"):
            raise ValueError(f"compare_on={self.compare_on!r} is not valid: expected 'final' or 'best'")
        run = self.run_location(context)
        if not parse_bool("require_metrics", self.require_metrics) and (
            self.store.head(run.bucket, run.key("output", "metrics.json")) is None
        ):
            # A third-party container need not write metrics: nothing to report or compare.
            self.log.info("No metrics.json in %s/output/: no report for this run", run.uri)
            return {**dict.fromkeys(RESULT_KEYS), "run_uri": run.uri}
        inputs = self.load_inputs(run)
        inputs.warnings.extend(note_lines(self.notes))
        inputs.disruptions = self.run_disruptions(run)
        inputs.image = self.image or None
        inputs.dataset_version = self.dataset_version or None
        inputs.command = command_words(self.command)
        self.describe_run(context, inputs)
        metrics = inputs.metrics

        if self.model:
            version, promoted = self.store.models.promoted_metrics(check_name("model", self.model))
            inputs.comparison = compare(metrics, promoted, version, on=self.compare_on)
            self.log.info("Comparison with the promoted %s: %s", self.model, inputs.comparison.reason)

        files = render_report(inputs)
        report_uri = self.store.reports.write(run, files)
        url = report_url(context["ti"].dag_id, run.bucket, run.key("report", "report.html"))
        context["ti"].xcom_push(key=REPORT_URL_XCOM_KEY, value=url)
        self.log.info("Report written to %s (%d files): %s", report_uri, len(files), url)

        comparison = inputs.comparison
        monitor = metrics["monitor"]
        section = metrics.get(self.compare_on)
        if not isinstance(section, dict):
            section = {}
        return {
            "run_uri": run.uri,
            "report_uri": report_uri,
            "report_url": url,
            "trainer": inputs.trainer,
            "monitor": monitor,
            "monitor_mode": metrics["monitor_mode"],
            "value": section.get(monitor),
            "final": metrics["final"],
            "best": metrics.get("best"),
            "epochs": metrics.get("epochs", inputs.epochs),
            "steps": metrics.get("steps"),
            "wall_time_s": metrics.get("wall_time_s"),
            "examples_per_s": metrics.get("examples_per_s"),
            "better_than_promoted": comparison.better if comparison else None,
            "promoted_metric": comparison.promoted_value if comparison else None,
            "promoted_version": comparison.promoted_version if comparison else None,
        }


def _count(name: str, value: Any) -> int | None:
    """A non-negative integer from an XCom or a template (``None`` or empty: unknown)."""
    if value in (None, "", "None"):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise ValueError(f"{name}={value!r} is not valid: expected a number of bytes or objects >= 0")
    return number
