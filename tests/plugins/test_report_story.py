"""A run report tells the whole story: the promotion's outcome (written by the promote task, which runs
after the report), the code version as the image's git revision, the hyperparameters the run set
apart from the defaults, the run's date, its dataset and a link back to the run in Airflow.

Pure rendering first, then the two operators in turn against the S3 test server, then the revision
read from a real registry.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from markupsafe import escape  # the reports' templates escape with it

from kubetrain.links import airflow_run_url
from kubetrain.report.inputs import ReportInputs, compare, user_set_params
from kubetrain.report.render import (
    PROMOTION_END,
    PROMOTION_START,
    promotion_outcome,
    render_report,
    with_promotion,
)

HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
METRICS = {
    "trainer": "image_classifier",
    "task": "classification",
    "monitor": "val_accuracy",
    "monitor_mode": "max",
    "final": {"loss": 0.49, "val_accuracy": 0.94},
    "epochs": 4,
}
DIGEST = "sha256:" + "9e" * 32
PARAMS = {
    "hyperparameters": {"epochs": 4, "learning_rate": 0.01, "batch_size": 32, "weights": ""},
    "image": f"localhost:5000/kubetrain/trainer@{DIGEST}",
    "code_version": DIGEST,
    "dataset_version": "04d598435446b7e2",
}


def inputs(**overrides) -> ReportInputs:
    values = {
        "run_uri": "s3://training/runs/train_image_classifier/manual__2026-11-29T04_14_28",
        "metrics": METRICS,
        "params": PARAMS,
        "comparison": compare(METRICS, None, None),
        "run_date": "2026-11-29 04:14 UTC",
        "airflow_url": "https://airflow.example/dags/train_image_classifier/runs/manual__2026-11-29T04%3A14%3A28",
        "dataset_uri": "s3://datasets/digits/",
        "dataset_bytes": 1_803_432,
        "dataset_objects": 1,
        "promote_rule": "if_better",
        **overrides,
    }
    return ReportInputs(**values)


def pages(report: ReportInputs) -> tuple[str, str]:
    files = render_report(report)
    return files["report.html"].decode(), files["report.md"].decode()


def block(document: str) -> str:
    """The promotion block of a report, markers included."""
    start, end = document.index(PROMOTION_START), document.index(PROMOTION_END)
    return document[start : end + len(PROMOTION_END)]


# -- the promotion's outcome ---------------------------------------------------------------------


def test_before_the_promote_task_the_report_says_the_decision_is_pending_and_calls_nothing_better():
    html, markdown = pages(inputs())
    assert (
        '<p class="neutral">No model was promoted before: there is none to compare this model with.</p>'
        in block(html)
    )
    assert '<p class="better">' not in html  # nothing is called better than a model that does not exist
    assert "Promotion (promote=if_better): not decided yet." in block(html)
    assert "Promotion (promote=if_better): not decided yet." in block(markdown)


@pytest.mark.parametrize(
    ("kwargs", "css", "sentence"),
    [
        (
            {"promoted": True, "rule": "if_better", "other_version": None, "other_value": None},
            "better",
            "Promoted as s3://training/models/digits/20261129T041428Z-6/ (model digits, version "
            "20261129T041428Z-6; promote=if_better): this run's val_accuracy 0.94; no version of digits "
            "was promoted before",
        ),
        (
            {"promoted": True, "rule": "always", "other_version": "v1", "other_value": 0.9},
            "better",
            "Promoted as s3://training/models/digits/20261129T041428Z-6/ (model digits, version "
            "20261129T041428Z-6; promote=always): this run's val_accuracy 0.94 against 0.9 of version v1, "
            "promoted before (higher is better)",
        ),
        (
            {"promoted": False, "rule": "if_better", "other_version": "v1", "other_value": 0.97},
            "worse",
            "Not promoted (promote=if_better, and it is not better than the promoted model): this run's "
            "val_accuracy 0.94 against 0.97 of version v1, promoted before (higher is better)",
        ),
        (
            {"promoted": False, "rule": "never", "other_version": "v1", "other_value": 0.5},
            "worse",
            "Not promoted (promote=never): this run's val_accuracy 0.94 against 0.5 of version v1, "
            "promoted before (higher is better)",
        ),
        (
            {"promoted": False, "rule": "if_better", "other_version": "v1", "other_value": None},
            "worse",
            "Not promoted (promote=if_better, and it is not better than the promoted model): this run's "
            "val_accuracy 0.94; the version promoted before, v1, has no val_accuracy",
        ),
    ],
)
def test_the_promote_task_writes_its_decision_with_both_figures(kwargs, css, sentence):
    promoted = kwargs["promoted"]
    outcome = promotion_outcome(
        model="digits",
        monitor="val_accuracy",
        mode="max",
        value=0.94,
        model_uri="s3://training/models/digits/20261129T041428Z-6/" if promoted else None,
        version="20261129T041428Z-6" if promoted else None,
        **kwargs,
    )
    assert outcome == {"css": css, "text": sentence}
    html, markdown = pages(inputs())
    new_html, new_markdown = with_promotion(html, "html", outcome), with_promotion(markdown, "md", outcome)
    assert block(new_html) == f'{PROMOTION_START}\n<p class="{css}">{escape(sentence)}.</p>\n{PROMOTION_END}'
    assert block(new_markdown) == f"{PROMOTION_START}\n**{sentence}.**\n{PROMOTION_END}"
    # the rest of each page is as the report wrote it, and a second decision (a retried task) replaces the first
    assert new_html.replace(block(new_html), "") == html.replace(block(html), "")
    assert new_markdown.replace(block(new_markdown), "") == markdown.replace(block(markdown), "")
    assert with_promotion(new_html, "html", outcome) == new_html
    assert "not decided yet" not in new_html + new_markdown


def test_a_decision_names_hostile_model_names_as_text():
    outcome = promotion_outcome(
        promoted=False, rule="never", model=HOSTILE, monitor=HOSTILE, mode="min", value=1.0,
        other_version=HOSTILE, other_value=2.0,
    )  # fmt: skip
    html = with_promotion(pages(inputs())[0], "html", outcome)
    assert "<script" not in html and f"this run&#39;s {ESCAPED} 1 against 2 of version {ESCAPED}" in html


def test_a_report_without_a_promotion_block_is_refused_by_name():
    with pytest.raises(ValueError, match=r"report.html has no promotion block"):
        with_promotion("<html><body>old report</body></html>", "html", {"css": "better", "text": "x"})


# -- code version, run, dataset, hyperparameters -------------------------------------------------


def summary(html: str) -> dict[str, str]:
    return dict(re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", html.split("<h2>Summary</h2>")[1]))


def test_the_code_version_is_the_git_revision_else_the_digest_with_the_reason():
    revised = summary(pages(inputs(revision="5f1c0ad9e2b7"))[0])
    assert revised["Code version"] == (
        "5f1c0ad9e2b7 (git revision, the image&#39;s org.opencontainers.image.revision label)"
    )
    unlabelled = summary(
        pages(inputs(revision_note="the image carries no org.opencontainers.image.revision label"))[0]
    )
    assert unlabelled["Code version"] == (
        f"{DIGEST} (the image&#39;s digest: the image carries no org.opencontainers.image.revision label)"
    )


def test_the_summary_gives_the_run_date_the_dataset_and_a_link_back_to_the_run():
    html, markdown = pages(inputs())
    rows = summary(html)
    assert rows["Run date"] == "2026-11-29 04:14 UTC"
    assert rows["Dataset"] == "s3://datasets/digits/: 1 object, 1.8 MB (1,803,432 bytes)"
    assert rows["Dataset version"] == "04d598435446b7e2"
    url = "https://airflow.example/dags/train_image_classifier/runs/manual__2026-11-29T04%3A14%3A28"
    assert f'<a href="{url}" title="its tasks, their logs and XComs">This run in Airflow</a>' in html
    assert f"[This run in Airflow]({url})" in markdown


def test_the_airflow_run_url_is_the_airflow_3_ui_route_from_the_base_url(monkeypatch):
    assert airflow_run_url("d", "manual__2026-11-29T04:14:28+00:00", base_url="https://airflow.example/") == (
        "https://airflow.example/dags/d/runs/manual__2026-11-29T04%3A14%3A28%2B00%3A00"
    )
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://localhost:8080/")
    assert airflow_run_url("d/x", "r") == "http://localhost:8080/dags/d%2Fx/runs/r"


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({"epochs": 4, "learning_rate": 0.001}, {"epochs": (4, 5)}),  # the form sends defaults too
        ({"epochs": 5.0, "weights": None}, {}),  # 5.0 is the default 5; None is the default ""
        ({"augment": 1}, {"augment": (1, False)}),  # a bool is not the number 1
        ({"unknown": 3}, {}),  # no Param: no setting of the run
        (None, {}),
        ("not a mapping", {}),
    ],
)
def test_a_setting_counts_as_set_by_the_run_only_where_it_differs_from_the_default(conf, expected):
    defaults = {"epochs": 5, "learning_rate": 0.001, "weights": "", "augment": False}
    assert user_set_params(conf, defaults) == expected


def test_hyperparameters_the_run_set_are_apart_from_the_defaults():
    user_set = {"epochs": (4, 5), "model_name": ("e2e-digits", "digits")}
    html, markdown = pages(inputs(user_set=user_set))
    section = html.split("<h2>Hyperparameters</h2>")[1]
    shown, folded = section.split("<details>")
    assert re.findall(r'<tr class="set"><th>([^<]*)</th>', shown) == ["epochs"]
    assert '<tr class="set"><th>epochs</th><td><code>4</code></td><td><code>5</code></td></tr>' in shown
    assert "<summary>3 at the DAG's defaults</summary>" in folded
    assert re.findall(r"<tr><th>([^<]*)</th>", folded.split("</details>")[0]) == [
        "batch_size",
        "learning_rate",
        "weights",
    ]
    # a Param the run set that is no hyperparameter is in the summary
    assert summary(html)["Set for this run"] == "model_name=e2e-digits"
    assert "| **epochs** | `4` | `5` |" in markdown and "\n\nAt the DAG's defaults:\n\n" in markdown
    # where the run's settings are not known, nothing is marked
    unmarked = pages(inputs())[0].split("<h2>Hyperparameters</h2>")[1]
    assert 'class="set"' not in unmarked and "<details>" not in unmarked
    assert "<tr><th>epochs</th><td><code>4</code></td></tr>" in unmarked


# -- the two operators in turn, against the S3 test server ---------------------------------------

RUN_AFTER = datetime(2026, 11, 29, 4, 14, 28, tzinfo=UTC)


class TrainedRun:
    """A finished run's output in S3, with the sidecar's final sync pass."""

    def __init__(self, client, model: str, value: float):
        from kubetrain.s3_layout import S3Layout

        self.client, self.model = client, model
        self.dag_id = f"train_{uuid.uuid4().hex[:8]}"
        self.run_id = "manual__2026-11-29T04:14:28+00:00"
        self.location = S3Layout().run(self.dag_id, self.run_id)
        metrics = {**METRICS, "final": {"loss": 0.5, "val_accuracy": value}}
        files = [
            self.upload("metrics.json", json.dumps(metrics).encode()),
            self.upload("params.json", json.dumps(PARAMS).encode()),
            self.upload("model.keras", b"keras zip bytes"),
        ]
        doc = {
            "kind": "kubetrain/sync-pass",
            "format_version": 1,
            "pass": 1,
            "final": True,
            "complete": True,
            "started_at": "2026-11-29T04:20:00Z",
            "finished_at": "2026-11-29T04:20:01Z",
            "pod": "train-abc",
            "files": files,
            "errors": [],
        }
        client.put_object(Bucket="training", Key=self.location.pass_key(1), Body=json.dumps(doc).encode())

    def upload(self, path: str, body: bytes) -> dict:
        key = self.location.key("output", path)
        sha = hashlib.sha256(body).hexdigest()
        self.client.put_object(Bucket="training", Key=key, Body=body, Metadata={"sha256": sha})
        return {"area": "output", "path": path, "key": key, "size": len(body), "sha256": sha}

    def context(self, task_id: str, conf: dict) -> dict:
        ti = SimpleNamespace(dag_id=self.dag_id, task_id=task_id, map_index=-1, try_number=1, xcom={})
        ti.xcom_push = lambda key, value: ti.xcom.__setitem__(key, value)
        dag_run = SimpleNamespace(run_after=RUN_AFTER, conf=conf)
        return {"ti": ti, "run_id": self.run_id, "dag_run": dag_run}

    def run(self, conf: dict) -> tuple[dict, dict]:
        """The report task, then the promote task, as the pipeline chains them."""
        from airflow.sdk import DAG, Param

        from kubetrain.operators.promote import PromoteModelOperator
        from kubetrain.operators.report import ReportOperator

        with DAG(self.dag_id, schedule=None, params={"epochs": Param(5), "learning_rate": Param(0.001)}):
            report = ReportOperator(
                task_id="report",
                model=self.model,
                promote="if_better",
                dataset_uri="s3://datasets/digits/",
                dataset_bytes="1803432",
                dataset_objects=1,
            )
            promote = PromoteModelOperator(
                task_id="promote", model=self.model, promote="if_better", final_pass_timeout=0
            )
        reported = report.execute(self.context("report", conf))
        promote.is_better = reported["better_than_promoted"]
        return reported, promote.execute(self.context("promote", conf))

    def read(self, name: str) -> str:
        body = self.client.get_object(Bucket="training", Key=self.location.key("report", name))["Body"]
        return body.read().decode()


def test_the_report_tells_what_the_promote_task_then_decided(client, monkeypatch):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example")
    model = f"digits-{uuid.uuid4().hex[:6]}"

    first = TrainedRun(client, model, 0.94)
    reported, promoted = first.run({"epochs": 4, "learning_rate": 0.001})
    assert reported["better_than_promoted"] is True and promoted["promoted"] is True
    html, markdown = first.read("report.html"), first.read("report.md")
    sentence = (
        f"Promoted as {promoted['model_uri']} (model {model}, version {promoted['model_version']}; "
        f"promote=if_better): this run&#39;s val_accuracy 0.94; no version of {model} was promoted before."
    )
    assert f'<p class="better">{sentence}</p>' in block(html)
    assert "not decided yet" not in html + markdown and "No model was promoted before" not in html
    assert "**" + sentence.replace("&#39;", "'") + "**" in markdown
    rows = summary(html)
    assert rows["Run date"] == "2026-11-29 04:14 UTC"
    assert rows["Dataset"] == "s3://datasets/digits/: 1 object, 1.8 MB (1,803,432 bytes)"
    url = f"https://airflow.example/dags/{first.dag_id}/runs/manual__2026-11-29T04%3A14%3A28%2B00%3A00"
    assert f'<a href="{url}"' in html
    assert '<tr class="set"><th>epochs</th><td><code>4</code></td><td><code>5</code></td></tr>' in html

    second = TrainedRun(client, model, 0.90)
    reported, kept = second.run({})
    assert reported["better_than_promoted"] is False and kept["promoted"] is False
    assert (
        '<p class="worse">Not promoted (promote=if_better, and it is not better than the promoted model): '
        f"this run&#39;s val_accuracy 0.9 against 0.94 of version {promoted['model_version']}, promoted "
        "before (higher is better).</p>"
    ) in block(second.read("report.html"))
    assert "This run set no hyperparameter" in second.read("report.html")


# -- the revision, from the image's labels in a real registry ------------------------------------


def push_labelled_image(port: int, labels: dict[str, str]) -> str:
    """Push a one-file image with ``labels`` to the registry on ``port``; return it by digest."""
    from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, Blob, RegistryClient, push_image

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    diff_id = "sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()
    layer = Blob.from_bytes(gzip.compress(raw.getvalue()), OCI_LAYER_GZIP, diff_id)
    config = {"architecture": "amd64", "os": "linux", "config": {"Labels": labels}}
    with RegistryClient(f"127.0.0.1:{port}", insecure=True, timeout=30) as client:
        digest = push_image(client, "kubetrain/trainer", "latest", [layer], config)
    return f"127.0.0.1:{port}/kubetrain/trainer@{digest}"


@pytest.fixture
def registry(tmp_path, monkeypatch):
    from tests.plugins.imagebuild.support import start_registry

    monkeypatch.delenv("AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT", raising=False)
    reg = start_registry(tmp_path / "registry")
    yield reg
    reg.stop()


def test_the_revision_is_read_from_the_images_label(registry):
    from kubetrain.operators.report import image_revision

    revision = "5f1c0ad9e2b7c1d4a6f8e0b2c4d6e8f0a1b3c5d7"
    labelled = push_labelled_image(registry.port, {"org.opencontainers.image.revision": revision})
    assert image_revision(labelled) == (revision, None)
    bare = push_labelled_image(registry.port, {"org.opencontainers.image.title": "trainer"})
    assert image_revision(bare) == (None, "the image carries no org.opencontainers.image.revision label")
    unknown = push_labelled_image(registry.port, {"org.opencontainers.image.revision": "unknown"})
    assert image_revision(unknown)[1] == (
        "the image's org.opencontainers.image.revision label says 'unknown' (built outside a git checkout)"
    )
    # a registry that cannot be asked leaves the digest, saying why; the report does not fail
    registry.stop()
    revision, note = image_revision(labelled)
    assert revision is None and note.startswith("the registry could not be asked for the image's labels (")
    assert image_revision(None) == (None, None)


def test_the_training_pages_report_link_opens_in_a_new_tab():
    from kubetrain.ui.app import Links, templates

    run = {
        "dag_id": "d",
        "run_id": "r",
        "ref": "d/r",
        "run_uri": "s3://training/runs/d/r",
        "report_url": "/kubetrain/reports/d/training/runs/d/r/report/report.html",
        "report_uri": "s3://training/runs/d/r/report/report.html",
        "mlflow": None,
        "sweep": None,
        "trial": None,
    }
    html = str(templates().get_template("macros.html").module.run_links(run, Links("/kubetrain/training")))
    assert (
        '<a href="/kubetrain/reports/d/training/runs/d/r/report/report.html" '
        'title="s3://training/runs/d/r/report/report.html" target="_blank" rel="noopener">report</a>'
    ) in html
