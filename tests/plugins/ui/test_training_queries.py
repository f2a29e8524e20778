"""What the Training page's API answers for seeded run records: filters, order, leaderboards, comparisons, sweeps."""

from __future__ import annotations

from datetime import timedelta

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from training_records import T0, make_record

from kubetrain.ui.charts import curves_svg
from kubetrain.ui.queries import NotVisible, QueryError, RunFilter, TrainingQueries, rank_trials, record_ref

ALL_DAGS = ["train_image_classifier", "train_custom_container", "train_dialogue_transformer"]


def ids(runs):
    return [r["run_id"].rsplit("-", 1)[1] for r in runs]


def test_runs_are_listed_newest_first_and_filtered(store, seeded):
    q = TrainingQueries(store, ALL_DAGS)
    digits, chat = seeded["digits"], seeded["chat"]
    assert ids(q.runs(RunFilter(model=digits)).runs) == [
        "4",
        "3",
        "2",
        "1",
        "0",
    ]  # secret_dag's run 7 is not readable
    assert ids(q.runs(RunFilter(model=chat)).runs) == ["6", "5"]
    assert ids(q.runs(RunFilter(model=digits, dag_id="train_custom_container")).runs) == ["4"]
    assert ids(q.runs(RunFilter(model=digits, dataset_version="0000000000000002")).runs) == ["4", "3", "2"]
    assert ids(q.runs(RunFilter(model=digits, status="failed")).runs) == ["3"]
    failed = q.runs(RunFilter(model=digits, status="failed")).runs[0]
    assert failed["failure"]["error"] == "PodFailed: OOMKilled" and failed["promotion"]["promoted"] is False
    # every model: this fixture's runs interleave by time
    mine = [r for r in q.runs(RunFilter(), limit=500).runs if seeded["tag"] in r["run_id"]]
    assert ids(mine) == ["4", "3", "2", "6", "1", "5", "0"]


def test_pages_continue_after_the_last_key(store, seeded):
    q = TrainingQueries(store, ALL_DAGS)
    first = q.runs(RunFilter(model=seeded["digits"]), limit=2)
    assert ids(first.runs) == ["4", "3"] and first.next_after
    second = q.runs(RunFilter(model=seeded["digits"]), after=first.next_after, limit=2)
    third = q.runs(RunFilter(model=seeded["digits"]), after=second.next_after, limit=2)
    assert ids(second.runs) == ["2", "1"] and ids(third.runs) == ["0"] and third.next_after is None


def test_a_viewer_sees_only_runs_of_dags_they_may_read(store, seeded):
    only_dialogue = TrainingQueries(store, ["train_dialogue_transformer"])
    assert only_dialogue.runs(RunFilter(model=seeded["digits"])).runs == []
    assert ids(only_dialogue.runs(RunFilter(model=seeded["chat"])).runs) == ["6", "5"]
    everything = TrainingQueries(store, [*ALL_DAGS, "secret_dag"])
    assert ids(everything.runs(RunFilter(model=seeded["digits"])).runs)[0] == "7"
    secret = seeded["runs"][7]
    with pytest.raises(NotVisible):
        TrainingQueries(store, ALL_DAGS).record(record_ref(secret))
    with pytest.raises(NotVisible):
        TrainingQueries(store, ALL_DAGS).compare([record_ref(secret), record_ref(seeded["runs"][0])])
    assert TrainingQueries(store, ALL_DAGS).leaderboard(seeded["digits"]).entries[0]["dag_id"] != "secret_dag"


def test_bad_filters_are_named(store):
    with pytest.raises(QueryError, match="dataset version 'latest' is not valid"):
        RunFilter(dataset_version="latest")
    with pytest.raises(QueryError, match="status 'running' is not valid"):
        RunFilter(status="running")
    with pytest.raises(QueryError, match="limit=0 is not valid"):
        TrainingQueries(store, []).runs(RunFilter(), limit=0)
    with pytest.raises(QueryError, match="is not a key of the run index"):
        TrainingQueries(store, []).runs(RunFilter(model="m"), after="index/_all/x")


def test_leaderboard_ranks_by_the_objective_and_marks_the_promoted_version(store, seeded):
    board = TrainingQueries(store, ALL_DAGS).leaderboard(seeded["digits"])
    assert board.metric == "val_accuracy" and board.mode == "max"
    assert [r["metrics"]["value"] for r in board.entries] == [
        0.95,
        0.90,
        0.85,
        0.80,
    ]  # the failed run is not ranked
    assert [r["is_promoted"] for r in board.entries] == [True, False, False, False]
    assert board.promoted["version"] == "v1"
    with pytest.raises(QueryError, match="has no leaderboard for metric 'bleu'"):
        TrainingQueries(store, ALL_DAGS).leaderboard(seeded["digits"], metric="bleu")


def test_leaderboard_of_a_metric_to_minimize_puts_the_lowest_first(store):
    for index, loss in enumerate([0.5, 0.2, 0.9]):
        store.runs.write(
            make_record(
                run_id=f"manual__loss-{index}",
                model="loss-model",
                monitor="val_loss",
                mode="min",
                value=loss,
                when=T0 + timedelta(hours=index),
            )
        )
    board = TrainingQueries(store, ALL_DAGS).leaderboard("loss-model")
    assert board.mode == "min" and [r["metrics"]["value"] for r in board.entries] == [0.2, 0.5, 0.9]
    assert board.promoted is None


def test_compare_puts_params_and_histories_side_by_side(store, seeded):
    q = TrainingQueries(store, ALL_DAGS)
    refs = [record_ref(seeded["runs"][i]) for i in (0, 1, 2)]
    found = q.compare(refs)
    assert [r["ref"] for r in found.runs] == refs
    assert [h.rows[-1]["val_accuracy"] for h in found.histories] == pytest.approx([0.76, 0.7695, 0.779])
    rows = {row["name"]: row for row in found.params}
    assert rows["batch_size"]["values"] == [32, 64, 32] and rows["batch_size"]["differs"] is True
    assert rows["learning_rate"]["differs"] is False and rows["learning_rate"]["source"] == "hyperparameters"
    assert rows["promote"]["source"] == "params"
    svg = curves_svg(["a", "b", "c"], found.histories)
    assert svg.startswith("<svg") and svg.count("<path") > 6
    with pytest.raises(QueryError, match="select 2 to 5 runs to compare: got 1"):
        q.compare(refs[:1] * 2)
    with pytest.raises(QueryError, match="select 2 to 5 runs to compare: got 6"):
        q.compare([f"train_image_classifier/manual__{i}" for i in range(6)])
    with pytest.raises(QueryError, match="run reference '../etc' is not valid"):
        q.compare(["../etc", refs[0]])
    with pytest.raises(NotVisible):
        q.compare([refs[0], "train_image_classifier/manual__never-ran"])


def test_a_sweep_is_built_from_its_trials_records(store):
    trials = []
    for trial, (lr, value, stopped) in enumerate(
        [(0.1, 0.7, True), (0.01, 0.93, False), (0.001, 0.88, False)]
    ):
        record = make_record(
            dag_id="sweep_image_classifier",
            run_id="manual__sweep-1",
            model="sweep-m",
            trial=str(trial),
            value=value,
            hyper={"learning_rate": lr, "epochs": 3},
            sweep={
                "id": "sweep_image_classifier/manual__sweep-1",
                "trial": str(trial),
                "stopped_early": stopped,
                "params": {"learning_rate": lr},
            },
        )
        store.runs.write(record)
        trials.append(record)
    store.runs.write(
        make_record(dag_id="sweep_image_classifier", run_id="manual__sweep-2", model="sweep-m", trial="0")
    )
    from kubetrain.ui.queries import sweep_time

    found = TrainingQueries(store, ["sweep_image_classifier"]).sweep(
        model="sweep-m",
        dag_id="sweep_image_classifier",
        run_id="manual__sweep-1",
        run_time=sweep_time(trials[0]),
    )
    assert [r["trial"] for r in found] == ["1", "2", "0"] and [r["rank"] for r in found] == [1, 2, 3]
    with pytest.raises(NotVisible):
        TrainingQueries(store, []).sweep(
            model="sweep-m", dag_id="sweep_image_classifier", run_id="x", run_time="0" * 13
        )


def test_trials_rank_failed_last_and_respect_the_sweep_objective():
    ok = make_record(
        run_id="a",
        trial="0",
        value=0.5,
        sweep={"id": "s", "trial": "0", "objective": {"name": "val_loss", "mode": "min", "value": 0.3}},
    )
    better = make_record(
        run_id="a",
        trial="1",
        value=0.4,
        sweep={"id": "s", "trial": "1", "objective": {"name": "val_loss", "mode": "min", "value": 0.1}},
    )
    failed = make_record(run_id="a", trial="2", status="failed", value=None)
    assert [r["trial"] for r in rank_trials([failed, ok, better])] == ["1", "0", "2"]


def test_a_filter_reads_a_bounded_number_of_keys_and_searches_on(store, seeded):
    q = TrainingQueries(store, ALL_DAGS)
    filt = RunFilter(model=seeded["digits"], status="failed")
    first = q.runs(
        filt, max_scan=2
    )  # the newest two: secret_dag's run 7 (not readable) and run 4 (succeeded)
    assert first.runs == [] and first.scanned == 2 and first.searched_all is False and first.next_after
    second = q.runs(filt, after=first.next_after, max_scan=2)
    assert ids(second.runs) == ["3"] and second.searched_all is False
    rest = q.runs(filt, after=second.next_after)
    assert rest.runs == [] and rest.searched_all is True and rest.next_after is None


def test_the_runs_list_shows_a_failed_run_with_its_step_and_reason(store):
    """A run that failed in staging (no run output, no metrics) is listed as failed, with the step and why."""
    import uuid

    from kubetrain.run_record import RunFacts, build_record
    from kubetrain.s3_layout import S3Layout
    from kubetrain.ui.app import Links, templates

    tag = uuid.uuid4().hex[:6]
    error = "DatasetRefused: dataset 's3://other/x/' is outside the deployment's dataset prefixes (s3://datasets/)"
    record = build_record(
        RunFacts(
            dag_id="train_image_classifier",
            run_id=f"manual__{tag}",
            run=S3Layout().run("train_image_classifier", f"manual__{tag}"),
            run_time=T0,
            model=f"refused-{tag}",
            status="failed",
            params={"dataset_uri": "s3://other/x/"},
            dataset_uri="s3://other/x/",
            failure={"task": "stage_dataset", "error": error},
        )
    ).to_dict()
    store.runs.write(record)

    found = TrainingQueries(store, ["train_image_classifier"]).runs(RunFilter(model=f"refused-{tag}"))
    assert [(r["status"], r["failure"]) for r in found.runs] == [
        ("failed", {"task": "stage_dataset", "error": error})
    ]
    html = (
        templates()
        .get_template("runs.html")
        .render(
            base="/training",
            links=Links("/training"),
            models=[f"refused-{tag}"],
            section="runs",
            model=None,
            title="Training runs",
            filt=RunFilter(),
            page=found,
            dags=["train_image_classifier"],
            next_url=None,
        )
    )
    row = html[html.index(f'data-ref="{found.runs[0]["ref"]}"') :].split("</tr>")[0]
    assert '<span class="status failed"' in row
    assert '<span class="mono">stage_dataset</span>' in row
    assert "is outside the deployment&#39;s dataset prefixes (s3://datasets/)" in row
    assert "not promoted: the run failed in stage_dataset" in row
