"""ReportOperator against the S3 test server: report files, metrics XCom and the comparison."""

from __future__ import annotations

import base64
import json
import re
import uuid
from types import SimpleNamespace

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.links import REPORT_URL_XCOM_KEY, ReportLink
from kubetrain.operators.report import ReportOperator
from kubetrain.report.inputs import compare, parse_history, parse_metrics
from kubetrain.s3_layout import S3Layout

HISTORY = b"""epoch,step,loss,accuracy,val_loss,val_accuracy,learning_rate,wall_time_s
1,40,1.92,0.41,1.55,0.52,0.001,3.1
2,80,1.10,0.68,0.98,0.71,0.001,6.0
3,120,0.61,0.84,0.70,0.80,0.0005,8.8
"""


def metrics(
    value: float, *, monitor: str = "val_accuracy", mode: str = "max", trainer: str = "image_classifier"
) -> dict:
    return {
        "trainer": trainer,
        "task": "classification",
        "monitor": monitor,
        "monitor_mode": mode,
        "final": {"loss": 0.61, "accuracy": 0.84, "val_loss": 0.70, monitor: value},
        "best": {monitor: value, "epoch": 3},
        "epochs": 3,
        "steps": 120,
        "resumed_from_step": 0,
        "wall_time_s": 8.8,
        "examples_per_s": 412.5,
        "devices": ["/physical_device:CPU:0"],
        "skipped_files": 0,
    }


class Run:
    """A finished training run's output in S3."""

    def __init__(self, client, **output: bytes):
        self.client = client
        self.dag_id = f"train_{uuid.uuid4().hex[:8]}"
        self.location = S3Layout().run(self.dag_id, "manual__2026-11-22T04:00:00+00:00")
        for name, body in output.items():
            client.put_object(
                Bucket="training", Key=self.location.key("output", name.replace("_json", ".json")), Body=body
            )

    def execute(self, **kwargs):
        op = ReportOperator(task_id="report", **kwargs)
        ti = SimpleNamespace(dag_id=self.dag_id, task_id="report", map_index=-1, xcom={})
        ti.xcom_push = lambda key, value: ti.xcom.__setitem__(key, value)
        result = op.execute({"ti": ti, "run_id": "manual__2026-11-22T04:00:00+00:00"})
        return result, ti.xcom

    def read(self, name: str) -> tuple[bytes, str]:
        got = self.client.get_object(Bucket="training", Key=self.location.key("report", name))
        return got["Body"].read(), got["ContentType"]


def promote(client, model: str, metrics_doc: dict, version: str = "20261101T000000Z-00000000") -> None:
    layout = S3Layout()
    client.put_object(
        Bucket="training",
        Key=layout.model_prefix(model, version) + "metrics.json",
        Body=json.dumps(metrics_doc).encode(),
    )
    client.put_object(
        Bucket="training", Key=layout.model_latest_key(model), Body=json.dumps({"version": version}).encode()
    )


def classifier_run(client, value: float = 0.80) -> Run:
    confusion = {"classes": ["0", "1", "2"], "matrix": [[9, 1, 0], [0, 8, 2], [1, 0, 9]]}
    params = {
        "trainer": "image_classifier",
        "hyperparameters": {"epochs": 3, "learning_rate": 0.001},
        "dataset_version": "3f2a9c0d1e4b5a69",
        "image": "localhost:5000/kubetrain/trainer:1",
        "code_version": "1",
    }
    return Run(
        client,
        metrics_json=json.dumps(metrics(value)).encode(),
        **{"history.csv": HISTORY},
        params_json=json.dumps(params).encode(),
        confusion_matrix_json=json.dumps(confusion).encode(),
    )


def test_report_files_and_metrics(client, monkeypatch):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example/")
    run = classifier_run(client)
    result, xcom = run.execute()

    html, html_type = run.read("report.html")
    images = re.findall(rb'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 4  # loss, accuracy, learning rate (it changes), confusion matrix
    assert all(base64.b64decode(i).startswith(b"\x89PNG\r\n\x1a\n") for i in images)
    assert html_type.startswith("text/html")
    assert b"3f2a9c0d1e4b5a69" in html and b"learning_rate" in html

    markdown, _ = run.read("report.md")
    assert b"![Loss per epoch](loss.png)" in markdown
    assert b"| Final val_accuracy | 0.8 |" in markdown
    for name in ("loss.png", "accuracy.png", "confusion_matrix.png"):
        body, content_type = run.read(name)
        assert body.startswith(b"\x89PNG") and content_type == "image/png"

    assert result["report_uri"] == f"{run.location.uri}/report/report.html"
    assert result["monitor"] == "val_accuracy" and result["value"] == 0.80
    assert result["final"]["loss"] == 0.61 and result["epochs"] == 3
    assert result["better_than_promoted"] is None  # no model named: no comparison
    expected_url = f"https://airflow.example/kubetrain/reports/{run.dag_id}/training/{run.location.prefix}/report/report.html"
    assert result["report_url"] == xcom[REPORT_URL_XCOM_KEY] == expected_url
    json.dumps(result)  # XCom-serialisable as is


@pytest.mark.parametrize(
    ("promoted_value", "new_value", "mode", "better"),
    [
        (0.75, 0.80, "max", True),
        (0.85, 0.80, "max", False),
        (0.80, 0.80, "max", False),
        (0.30, 0.25, "min", True),
        (0.20, 0.25, "min", False),
    ],
)
def test_comparison_with_the_promoted_model(client, promoted_value, new_value, mode, better):
    model = f"digits-{uuid.uuid4().hex[:6]}"
    monitor = "val_accuracy" if mode == "max" else "val_loss"
    promote(client, model, metrics(promoted_value, monitor=monitor, mode=mode))
    run = Run(client, metrics_json=json.dumps(metrics(new_value, monitor=monitor, mode=mode)).encode())
    result, _ = run.execute(model=model)

    assert result["better_than_promoted"] is better
    assert result["promoted_metric"] == promoted_value
    assert result["promoted_version"] == "20261101T000000Z-00000000"
    html, _ = run.read("report.html")
    assert (b"This model is better than the promoted model" in html) is better
    assert b"history.csv is missing" in html


def test_first_model_is_better_than_nothing(client):
    run = Run(client, metrics_json=json.dumps(metrics(0.5)).encode())
    result, _ = run.execute(model=f"fresh-{uuid.uuid4().hex[:6]}")
    assert result["better_than_promoted"] is True and result["promoted_metric"] is None


def test_dialogue_samples_are_escaped(client):
    samples = [
        {"step": 100, "input": "hi <script>alert(1)</script>", "reply": "hello | there", "reference": "hello"}
    ]
    doc = metrics(0.31, trainer="dialogue")
    doc["task"] = "seq2seq"
    run = Run(
        client,
        metrics_json=json.dumps(doc).encode(),
        samples_json=json.dumps(samples).encode(),
        **{"history.csv": HISTORY},
    )
    run.execute()
    html, _ = run.read("report.html")
    assert b"<script>alert" not in html and b"hi &lt;script&gt;alert(1)&lt;/script&gt;" in html
    markdown, _ = run.read("report.md")
    assert b"| 100 | hi <script>alert(1)</script> | hello \\| there | hello |" in markdown


def test_missing_metrics_fail_naming_the_object(client):
    run = Run(client, **{"history.csv": HISTORY})
    with pytest.raises(
        FileNotFoundError, match=f"no metrics.json at {re.escape(run.location.uri)}/output/metrics.json"
    ):
        run.execute()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "metrics.json is not valid JSON"),
        (
            json.dumps({**metrics(0.5), "monitor_mode": "up"}).encode(),
            "monitor_mode='up': expected 'max' or 'min'",
        ),
        (json.dumps({**metrics(0.5), "monitor": None}).encode(), "monitor=None"),
    ],
)
def test_bad_metrics_are_refused(body, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_metrics(body)


def test_history_needs_its_header():
    with pytest.raises(ValueError, match="expected at least 'epoch' and 'loss'"):
        parse_history(b"1,2,3\n")
    history = parse_history(HISTORY)
    assert history.metric == "accuracy"
    assert history.series("val_accuracy") == ([1.0, 2.0, 3.0], [0.52, 0.71, 0.80])


def test_compare_on_best():
    new, old = metrics(0.8), metrics(0.9)
    new["best"]["val_accuracy"] = 0.95
    assert compare(new, old, "v1", on="final").better is False
    assert compare(new, old, "v1", on="best").better is True


def test_plugin_registers_the_report_link():
    from airflow import plugins_manager

    assert not [p for p in plugins_manager.get_import_errors() if p.endswith("kubetrain_plugin.py")]
    links = [link for link in plugins_manager.get_operator_extra_links() if isinstance(link, ReportLink)]
    assert [link.name for link in links] == ["Training report"]
    assert [link.name for link in ReportOperator.operator_extra_links] == ["Training report"]
    apps = plugins_manager.get_fastapi_plugins()[0]
    assert [(a["url_prefix"], type(a["app"]).__name__) for a in apps if a["url_prefix"] == "/kubetrain"] == [
        ("/kubetrain", "ReportsApp")
    ]


def test_the_training_task_notes_open_the_report(client):
    note = (
        "GPU request served on CPU: pod train-abc asked for 1 nvidia.com/gpu, but node kubetrain-dev has none "
        "(its capacity lists no nvidia.com/gpu), so it trains on CPU"
    )
    run = classifier_run(client)
    run.execute(notes=[note])
    html = run.read("report.html")[0].decode()
    # One line, right under the title, before the comparison and the summary.
    assert html.index(f'<p class="warning">{note}</p>') < html.index("<h2>Summary</h2>")
    assert html.index("<h1>") < html.index('class="warning"')
    assert f"> **{note}**" in run.read("report.md")[0].decode()
    # No notes (the XCom of a run on GPUs is an empty list): no warning line.
    quiet = classifier_run(client)
    quiet.execute(notes=[])
    assert b'class="warning"' not in quiet.read("report.html")[0]
    with pytest.raises(ValueError, match="notes 3 is not a list of lines"):
        classifier_run(client).execute(notes=3)


def test_an_image_of_your_own_gets_its_digest_dataset_version_trainer_and_epochs(client):
    # a container of the user's own: the contract's required fields only, no params.json
    own = {"monitor": "val_accuracy", "monitor_mode": "max", "final": {"loss": 0.61, "val_accuracy": 0.8}}
    run = Run(client, metrics_json=json.dumps(own).encode(), **{"history.csv": HISTORY})
    image = "localhost:5000/examples/keras-model@sha256:" + "ab" * 32
    result, _ = run.execute(
        image=image, dataset_version="3f2a9c0d1e4b5a69", command=["python", "train.py"], model=None
    )

    markdown = run.read("report.md")[0].decode()
    assert f"| Image | {image} |" in markdown
    assert "| Dataset version | 3f2a9c0d1e4b5a69 |" in markdown
    assert "| Trainer | examples/keras-model (command: python train.py) |" in markdown
    assert '| Task | not stated (metrics.json has no "task") |' in markdown
    assert "| Epochs | 3 |" in markdown  # history.csv's last epoch
    # the run record takes the trainer and the epochs from these
    assert (result["trainer"], result["epochs"]) == ("examples/keras-model", 3)
