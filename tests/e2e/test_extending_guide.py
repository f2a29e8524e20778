"""docs/extending.md, executed as written: its `bash` blocks, taken from the page, run word for word.

The guide marks its dev-stack path as fenced `bash` blocks (docs/extending.md, "How to read the
commands"): try the script with the trainer environment, build and push the image to the dev
stack's registry, upload the data, run the DAG as the demos run theirs (`python -m include.demo
run`: `airflow dags test` into the metadata database `make airflow` serves, on the dev stack's
Postgres). This test extracts those blocks and runs them, in page order, in one bash process
with a user's fresh environment (a system PATH, nothing of Airflow, AWS or kubetrain set), from
a checkout whose `.stack` is this session's dev stack, as `make stack-up` would have left it.
The checkout is the repository itself, seen through links, with its own `.stack`, `.airflow`
and `.demo`: the developer's are left alone. Its `include` is a copy, not a link: the demo
runner finds the checkout (its `.airflow`, `.demo`, `dags`) from its own file's place.

The guide's indented blocks target a cluster and a registry of the reader's own
(`registry.example.com`, `aws s3 cp` with real credentials): they are not run, each for the
reason the test prints, and each must have a `bash` block that does the same on the dev stack.

The run must end with a report that shows the image by digest, the dataset version, the Trainer
and Task rows, and a run record with the epochs trained.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import sqlalchemy

from include.airflow_ui import AirflowUI
from include.devstack.stack import s3_client

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "extending.md"
DAG_ID = "example_keras_model"
MODEL = "keras-digits"
TASKS = ("stage_dataset", "check_new", "train", "report", "promote", "record")
# what a checkout's user has of their own, beside the tracked tree: the dev stack, Airflow's home, demo data
OWN = (".stack", ".airflow", ".demo")
FENCED = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
INDENTED = re.compile(r"(?:^\n)((?:^ {4}\S.*\n(?:^ {4}.*\n)*)+)", re.M)


def guide_blocks(text: str) -> tuple[list[str], list[str]]:
    """The guide's dev-stack blocks (fenced ``bash``) and its other blocks (indented), in page order.

    :param text: the guide's Markdown.
    """
    run = [body for language, body in FENCED.findall(text) if language == "bash"]
    rest = FENCED.sub("", text)
    shown = ["".join(line[4:] + "\n" for line in block.splitlines()) for block in INDENTED.findall(rest)]
    return run, shown


def why_not_run(block: str) -> str:
    """Why an indented block of the guide is not run here, and which dev-stack block stands in for it."""
    if block.startswith("FROM "):
        return "the example's Dockerfile (docs/examples/keras_model/Dockerfile, built by the dev-stack block)"
    if "registry.example.com" in block:
        return "builds and pushes to the reader's own registry (the dev-stack block: include.devstack.build)"
    if "aws s3 cp" in block or "airflow dags test" in block:
        return "a cluster's S3 credentials and Airflow (the dev-stack block: .stack/env, boto3, include.demo run)"
    raise AssertionError(
        f"an indented block of docs/extending.md that is neither run nor explained:\n{block}"
    )


def user_checkout(root: Path, stack_dir: Path) -> Path:
    """The repository as a user's checkout after `make setup` and `make stack-up`, with its own
    ``.stack`` (this session's dev stack), ``.airflow`` (empty: the demo runner makes its database on
    the dev stack's Postgres) and no ``.demo`` yet.

    :param root: an empty folder to make it in.
    :param stack_dir: the session's dev stack's state folder (env file, state, kubeconfigs).
    """
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name in OWN:
            continue
        if entry.name == "include":  # a copy: include/demo.py takes the checkout from its own path
            shutil.copytree(entry, root / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (root / entry.name).symlink_to(entry)
    (root / ".stack").symlink_to(stack_dir)
    (root / ".airflow").mkdir()
    return root


def fresh_env(tmp: Path) -> dict[str, str]:
    """A login shell's environment: a system PATH and a home, none of the test run's own variables."""
    home = tmp / "home"
    home.mkdir()
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "USER": os.environ.get("USER", "root"),
        "TMPDIR": str(tmp),
    }


def markdown_summary(report_md: str) -> dict[str, str]:
    """The report's summary table (``| label | value |`` rows) as a dict."""
    rows = re.findall(r"^\| (.+?) \| (.*?) \|$", report_md, re.M)
    return {label: value for label, value in rows}


def test_the_guide_runs_word_for_word_on_the_dev_stack(devstack, tmp_path, monkeypatch):
    run_blocks, shown_blocks = guide_blocks(GUIDE.read_text())
    assert run_blocks, "docs/extending.md has no `bash` blocks: nothing of the dev-stack path to run"
    for block in shown_blocks:
        print(f"not run: {block.splitlines()[0]} ... -- {why_not_run(block)}")
    script = "\n".join(run_blocks)
    # the cluster's steps have their dev-stack equivalents among the blocks that run
    for step in (
        "include.devstack.build docs/examples/keras_model",
        "keras-digits/digits.zip",
        "include.demo run " + DAG_ID,
    ):
        assert step in script, f"no `bash` block of docs/extending.md does {step!r}"

    env = devstack.env()
    checkout = user_checkout(tmp_path / "checkout", devstack.state_dir)
    (tmp_path / "guide.sh").write_text(script)
    log = tmp_path / "guide.log"
    start = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", str(tmp_path / "guide.sh")],
            cwd=checkout,
            env=fresh_env(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
    output = log.read_text(errors="replace")
    print(f"the guide's {len(run_blocks)} bash blocks ran in {time.monotonic() - start:.0f} s")
    assert done.returncode == 0, (
        f"docs/extending.md's bash blocks failed ({done.returncode}):\n{output[-6000:]}"
    )

    # the script tried without a cluster: Keras' epochs and the metrics.json the guide shows
    assert '"monitor": "val_accuracy"' in output and "trained 2 epochs" in output
    # the demo runner's last line names the run, which it ran into make airflow's database
    found = re.search(rf"^{DAG_ID} run (\S+): success in \d+ s \(in `make airflow`\)$", output, re.M)
    assert found, output[-4000:]
    run_id = found[1]
    # the DAG ran the unmodified script in the training pod from the image the guide pushed
    dags_test_log = (checkout / ".demo" / f"{DAG_ID}.log").read_text(errors="replace")
    assert "[base] Epoch 2/2" in dags_test_log and "[base] trained 2 epochs: val_accuracy" in dags_test_log

    # the run is in the database that make airflow serves for the checkout's .airflow
    ui_db = AirflowUI(checkout / ".airflow", env)
    assert ui_db.database is not None, "the demo runner made no metadata database on the dev stack's Postgres"
    for name, value in ui_db.postgres.env().items():  # where libpq finds the password
        monkeypatch.setenv(name, value)
    engine = sqlalchemy.create_engine(ui_db.sql_alchemy_conn())
    try:
        with engine.connect() as conn:
            query = {"dag": DAG_ID, "run": run_id}
            state = conn.execute(
                sqlalchemy.text("SELECT state FROM dag_run WHERE dag_id = :dag AND run_id = :run"), query
            ).scalar_one()
            states = dict(
                conn.execute(
                    sqlalchemy.text(
                        "SELECT task_id, state FROM task_instance WHERE dag_id = :dag AND run_id = :run"
                    ),
                    query,
                ).all()
            )
            xcoms = {
                task: json.loads(value) if isinstance(value, str | bytes) else value
                for task, value in conn.execute(
                    sqlalchemy.text(
                        "SELECT task_id, value FROM xcom WHERE dag_id = :dag AND run_id = :run "
                        "AND key = 'return_value'"
                    ),
                    query,
                ).all()
            }
    finally:
        engine.dispose()
    assert state == "success" and states == dict.fromkeys(TASKS, "success"), (state, states)
    image, version = xcoms["check_new"]["image"], xcoms["stage_dataset"]["version"]
    assert re.fullmatch(
        rf"{re.escape(env['KUBETRAIN_REGISTRY'])}/examples/keras-model@sha256:[0-9a-f]{{64}}", image
    )

    s3 = s3_client(env)

    def read(uri: str) -> bytes:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    # the report the guide promises: the image by digest, the dataset version, the Trainer and Task rows
    report_uri = xcoms["report"]["report_uri"]
    summary = markdown_summary(read(report_uri.removesuffix(".html") + ".md").decode())
    assert summary["Image"] == image and summary["Dataset version"] == version, summary
    assert (summary["Trainer"], summary["Task"], summary["Epochs"]) == ("keras_model", "classification", "2")
    assert f"Report written to {report_uri}" in dags_test_log

    # the run record (the Training page and the leaderboard read it): digest, dataset version, epochs
    record = json.loads(read(xcoms["record"]["run_record"]))
    assert record["image"]["digest"] == image.rpartition("@")[2] and record["dataset"]["version"] == version
    assert (record["trainer"], record["epochs"], record["status"]) == ("keras_model", 2, "success")
    assert xcoms["promote"]["promoted"] is True, xcoms["promote"]
    latest = json.loads(s3.get_object(Bucket="training", Key=f"models/{MODEL}/latest")["Body"].read())
    assert s3.head_object(Bucket="training", Key=f"models/{MODEL}/{latest['version']}/model.keras")[
        "ContentLength"
    ]
