"""The end of a sweep against the test S3 server: every planned trial, the ranking, the leaderboard and
the sweep record."""

from __future__ import annotations

import json

import jsonschema
import pytest
from airflow.sdk.exceptions import AirflowFailException

from kubetrain.sweep.leaderboard import RecordSweepOperator, SweepReportOperator, best_trial
from kubetrain.sweep.records import assemble_trial, counts, ranked
from kubetrain.sweep.store import NO_RECORD, all_trials, write_trial
from kubetrain_contract.trial import ReusedFrom, SweepRecord, TrialRecord

SPACE = {"learning_rate": [0.1, 0.01, 0.001, 0.0001]}


def trial(number: int, value: float | None, *, error: str | None = None, **fields) -> TrialRecord:
    settings = {"id": "s/r", "objective": {"metric": "val_accuracy", "mode": "max"}}
    return assemble_trial(
        settings,
        number,
        round=0,
        params={"learning_rate": SPACE["learning_rate"][number]},
        fingerprint=None,
        run_uri=f"s3://training/runs/s/r/trials/{number}",
        finished_at="2026-11-22T04:30:00Z",
        value=value,
        values=[] if value is None else [value],
        error=error,
        **fields,
    )


@pytest.mark.parametrize(("mode", "order"), [("max", [2, 0, 1, 3]), ("min", [0, 2, 1, 3])])
def test_trials_rank_by_the_objective_those_without_a_value_last(mode, order):
    trials = [trial(0, 0.5), trial(1, None), trial(2, 0.9, stopped_early=True), trial(3, None, error="oom")]
    assert [t.number for t in ranked(trials, mode)] == order
    assert best_trial(ranked(trials, mode)).number == order[0]
    assert counts(trials) == {"succeeded": 2, "stopped_early": 1, "failed": 1}
    assert best_trial([trial(3, None, error="oom"), trial(1, None)]) is None


def planned(sweep, numbers: list[int]) -> None:
    doc = {
        "kind": "kubetrain/sweep-round",
        "format_version": 1,
        "round": 0,
        "algorithm": "grid",
        "trials": [{"number": n, "params": {"learning_rate": SPACE["learning_rate"][n]}} for n in numbers],
    }
    sweep.put(sweep.location.round_key(0), doc)


def test_every_planned_trial_is_listed_one_that_left_no_record_as_failed(sweep):
    planned(sweep, [0, 1, 2])
    write_trial(sweep.store, "training", sweep.location.trial_record_key(0), trial(0, 0.5))
    write_trial(sweep.store, "training", sweep.location.trial_record_key(2), trial(2, 0.7))
    trials = all_trials(sweep.store, sweep.location)
    assert [(t.number, t.status) for t in trials] == [(0, "success"), (1, "failed"), (2, "success")]
    assert trials[1].error == NO_RECORD and trials[1].run_uri == sweep.location.trial_run(1).uri
    assert trials[1].params == {"learning_rate": 0.01}


def operators(sweep, cls, **kwargs):
    op = cls(task_id=cls.__name__, **kwargs)
    op.store = sweep.store
    return op


def test_the_leaderboard_names_the_best_trial_and_the_sweep_record_keeps_every_trial(sweep):
    sweep.plan(SPACE)
    planned(sweep, [0, 1, 2, 3])
    reused = ReusedFrom(run_uri="s3://training/runs/s/earlier/trials/5", sweep="s/earlier", trial="5")
    for record in (trial(0, 0.5), trial(1, 0.9, reused_from=reused), trial(2, None, error="exit 65")):
        write_trial(sweep.store, "training", sweep.location.trial_record_key(record.number), record)
    context = sweep.context()
    board = operators(sweep, SweepReportOperator, title="Flowers").execute(context)
    assert (board["best_trial"], board["best_value"], board["best_run_uri"]) == (
        "1",
        0.9,
        trial(1, 0.9).run_uri,
    )
    assert (board["trials"], board["succeeded"], board["failed"], board["stopped_early"]) == (4, 2, 2, 0)
    markdown = sweep.get(sweep.location.run.key("report", "report.md")).decode()
    assert "failed: exit 65" in markdown and "reused" in markdown and "without a record" in markdown
    assert context["ti"].xcoms["report_url"] == board["report_url"]
    result = operators(sweep, RecordSweepOperator, leaderboard=board, promotion={"promoted": False}).execute(
        context
    )
    body = sweep.get(sweep.location.record_key)
    jsonschema.validate(json.loads(body), SweepRecord.json_schema())
    record = SweepRecord.from_json(body)
    assert (
        record.best.best_trial == "1"
        and record.counts.failed == 2
        and record.objective.metric == "val_accuracy"
    )
    assert record.id == f"{sweep.dag_id}/{sweep.run_id}" and record.dataset.version == "v1"
    assert result["run_records"] == []  # the plan names no model
    document = json.loads(body)
    assert [t["number"] for t in document["trials"]] == [0, 1, 2, 3]
    assert (
        document["trials"][1]["reused_from"]["sweep"] == "s/earlier"
        and "history" not in document["trials"][1]
    )
    assert document["best"] == {"best_trial": "1", "best_run_uri": board["best_run_uri"], "best_value": 0.9}


def test_no_trial_with_a_result_fails_the_leaderboard_naming_each_trial(sweep):
    sweep.plan(SPACE)
    planned(sweep, [0, 1])
    write_trial(sweep.store, "training", sweep.location.trial_record_key(0), trial(0, None, error="exit 65"))
    with pytest.raises(
        AirflowFailException, match=r"no trial of the sweep has a val_accuracy.*0: failed exit 65"
    ):
        operators(sweep, SweepReportOperator).execute(sweep.context())
