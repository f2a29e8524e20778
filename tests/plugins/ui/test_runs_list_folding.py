"""The runs list's rows and filter: a sweep folded into one row, and only the DAGs that train offered."""

from __future__ import annotations

import uuid

from training_records import make_record

from kubetrain.ui.app import Links, templates
from kubetrain.ui.queries import RunFilter, RunsPage, TrainingQueries, fold_sweeps, record_ref


def trial(run_id: str, number: int, value: float | None, **sweep) -> dict:
    return make_record(
        dag_id="sweep_image_classifier",
        run_id=run_id,
        model="m",
        trial=str(number),
        value=value,
        status="success" if value is not None else "failed",
        sweep={"id": f"sweep_image_classifier/{run_id}", "trial": str(number), **sweep},
    )


def test_the_trials_of_a_sweep_fold_into_one_row_in_the_place_of_its_first():
    single = make_record(run_id="single")
    later = make_record(run_id="later")
    trials = [
        trial("s1", 0, 0.7),
        trial("s1", 1, 0.9),
        trial("s1", 2, 0.6, stopped_early=True),
        trial("s1", 3, None),
    ]
    rows = fold_sweeps([later, *trials, single, trial("s2", 0, 0.5)])
    assert [r.get("run_id") or r["best"]["run_id"] for r in rows] == ["later", "s1", "single", "s2"]
    folded = rows[1]
    assert folded["folded_sweep"] is True and len(folded["trials"]) == 4
    assert folded["best"]["trial"] == "1" and folded["best"]["metrics"]["value"] == 0.9
    assert folded["counts"] == {"success": 3, "failed": 1, "stopped_early": 1}
    assert folded["promoted"] is None
    # the records themselves are not changed (the JSON API still lists the trials as they are)
    assert "rank" not in trials[0]


def test_the_runs_page_shows_a_sweep_as_one_row_that_opens_its_trials():
    rows = [make_record(run_id="single"), trial("s1", 0, 0.7), trial("s1", 1, 0.9)]
    page = RunsPage([{**r, "ref": record_ref(r)} for r in rows], None)  # as the queries answer them
    html = (
        templates()
        .get_template("runs.html")
        .render(
            base="/training",
            links=Links("/training"),
            models=["m"],
            section="runs",
            model=None,
            title="Training runs",
            filt=RunFilter(),
            page=page,
            dags=["sweep_image_classifier", "train_image_classifier"],
            next_url=None,
        )
    )
    body = html[html.index("<tbody>") : html.index("</tbody>")]
    assert body.count("<tr") == 2
    row = body[body.index('class="sweep-row"') :].split("</tr>")[0]
    assert "2 trials →" in row and "/training/sweeps/sweep_image_classifier/s1?model=m&amp;t=" in row
    assert "val_accuracy</span> 0.9" in row and "2 finished" in row


def test_the_dag_filter_offers_the_dags_whose_runs_write_records(store):
    from kubetrain.store.runs_db import RunsIndex

    tag = uuid.uuid4().hex[:6]
    trains, builds, checks = f"train_{tag}", f"build_image_{tag}", f"preflight_{tag}"
    store.runs.write(make_record(dag_id=trains, run_id="r1", model=f"m-{tag}"))
    readable = [checks, trains, builds]
    # the run index database, and the key walk's stand-in (the DAG folders below runs/)
    assert TrainingQueries(store, readable, RunsIndex(store)).training_dags() == [trains]
    assert TrainingQueries(store, readable).training_dags() == [trains]
    # a DAG the viewer may not read is not offered, records or not
    assert TrainingQueries(store, [builds], RunsIndex(store)).training_dags() == []
