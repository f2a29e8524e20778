"""The end of a sweep against the test S3 server: every planned trial, the ranking, the leaderboard and
the sweep record."""

from __future__ import annotations

import json

import jsonschema
import pytest
from airflow.sdk.exceptions import AirflowFailException

from kubetrain.sweep.leaderboard import RecordSweepOperator, SweepReportOperator, best_trial
from kubetrain.sweep.records import (
    assemble_trial,
    compute_fields,
    compute_line,
    counts,
    cpu_cores,
    ranked,
    sweep_compute,
    trainer_seconds,
)
from kubetrain.sweep.store import NO_RECORD, all_trials, write_trial
from kubetrain_contract.trial import ReusedFrom, SweepCompute, SweepRecord, TrialRecord

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


def timed(
    number: int, seconds: float | None, reports: int, *, gpus: int = 1, cpu: str = "2", **fields
) -> TrialRecord:
    """A trial that trained ``seconds`` over ``reports`` reports on ``gpus`` GPUs (0: on ``cpu`` cores)."""
    return trial(number % 4, 0.5, reports=reports, **compute_fields(seconds, gpus=gpus, cpu=cpu), **fields)


def test_the_trainer_time_is_the_containers_run_else_the_trainers_wall_time():
    timing = {"base": {"started": "2026-11-22T04:01:00Z", "finished": "2026-11-22T04:02:30.5Z"}}
    assert trainer_seconds(timing, 12.0) == 90.5
    assert trainer_seconds({"base": {"started": "2026-11-22T04:01:00Z", "finished": None}}, 12) == 12.0
    assert trainer_seconds({"pod_created": None}) is None and trainer_seconds(None, "soon") is None
    assert [cpu_cores(q) for q in ("2", "500m", "1.5", 3, "lots", None)] == [2.0, 0.5, 1.5, 3.0, None, None]
    assert compute_fields(None, gpus=0, cpu="1") == {
        "trainer_seconds": None,
        "accelerator": "cpu",
        "accelerators": 1.0,
        "accelerator_hours": None,
    }


def test_a_stopped_trial_counts_its_own_rate_times_its_budget_the_others_what_they_ran():
    # 16 trials on one GPU each, a budget of 10 reports; a finished trial runs 10 reports in 1 h
    finished = [timed(n, 3600, 10) for n in range(5)]
    stopped = [timed(n, 720, 2, stopped_early=True) for n in range(5, 16)]  # 2 reports of 10 each
    compute = sweep_compute([*finished, *stopped], rule="median", fixed_params={"epochs": 10})
    assert compute.accelerator == "gpu" and (compute.trials, compute.stopped, compute.unknown) == (16, 11, 0)
    assert compute.compute_used == pytest.approx(5 + 11 * 0.2)
    assert compute.compute_full == pytest.approx(16.0)
    assert compute.saved_fraction == pytest.approx(1 - 7.2 / 16)
    assert compute.line == (
        "early stopping (median) stopped 11 of 16 trials and saved 55% of 16 GPU-hours (used 7.2)"
    )


def test_a_stopped_trials_remaining_reports_cost_what_the_finished_trials_paid_per_report():
    # A stopped trial's own rate carries its start-up: 2 reports in 0.3 h on 2 GPUs (0.075 h a
    # report and GPU) where trials that ran to their end of 10 reports paid 0.05 h a report and GPU
    finished = [timed(0, 1800, 10), timed(1, 1800, 10), timed(2, 2160, 10, gpus=2)]
    stopped = timed(3, 540, 2, gpus=2, stopped_early=True)
    compute = sweep_compute([*finished, stopped], rule="asha", max_resource=10)
    # the finished trials' median, 0.05 h a report and GPU, for the 8 reports it did not run on 2 GPUs
    assert compute.compute_full == pytest.approx(0.5 + 0.5 + 1.2 + 0.3 + 8 * 0.05 * 2)
    # with no trial that ran to its end, its own rate: 0.3 h x 10 / 2
    alone = sweep_compute([stopped, timed(4, 3600, 3, error="exit 65")], rule="asha", max_resource=10)
    assert alone.compute_full == pytest.approx(1.5 + 1.0)


@pytest.mark.parametrize(
    ("trials", "rule", "line"),
    [
        # nothing stopped: nothing saved
        (
            [timed(0, 1800, 4), timed(1, 1800, 4)],
            "median",
            "stopped 0 of 2 trials and saved 0% of 1.0 GPU-hours",
        ),
        # no GPU asked for: CPU-hours of the CPU request (2 cores x 0.5 h x 2)
        (
            [timed(0, 1800, 4, gpus=0), timed(1, 1800, 4, gpus=0)],
            "off",
            "no early stopping: 2 trial(s) used 2.0 CPU-hours",
        ),
        # a failed trial counts what it ran in both figures
        (
            [timed(0, 3600, 4), timed(1, 360, 1, error="exit 65")],
            "median",
            "saved 0% of 1.1 GPU-hours (used 1.1); 1 failed trial(s) counted as they ran",
        ),
        # a trial without timing is named, not guessed
        (
            [timed(0, 3600, 4), timed(1, 900, 1, stopped_early=True), timed(2, None, 4)],
            "median",
            "stopped 1 of 3 trials and saved 38% of 2.0 GPU-hours (used 1.2); "
            "1 trial(s) without trainer time, resources or budget not counted",
        ),
        # the budget of a stopped trial comes from the finished trials' reports when no epochs are known
        ([timed(0, 3600, 8), timed(1, 900, 2, stopped_early=True)], "asha", "saved 38% of 2.0 GPU-hours"),
        (
            [
                timed(0, None, 4),
                assemble_trial(None, 1, round=0, params={}, fingerprint=None, run_uri=None, finished_at=None),
            ],
            "median",
            "compute unknown: no trial of 2 has its trainer time and resources",
        ),
    ],
)
def test_the_compute_line_says_what_was_saved_and_what_it_could_not_count(trials, rule, line):
    compute = sweep_compute(trials, rule=rule)
    assert line in compute.line


def test_a_reused_trial_ran_nothing_here_and_old_records_fall_back_to_their_timing():
    reused = ReusedFrom(run_uri="s3://training/runs/s/earlier/trials/5", sweep="s/earlier", trial="5")
    old = trial(
        1,
        0.4,
        reports=4,
        timing={"base": {"started": "2026-11-22T04:00:00Z", "finished": "2026-11-22T05:00:00Z"}},
    )
    old = TrialRecord.from_dict({**old.to_dict(), "accelerator": "gpu", "accelerators": 2})
    compute = sweep_compute([timed(0, 3600, 4, reused_from=reused), old], rule="median")
    assert (compute.reused, compute.trials, compute.compute_used) == (1, 1, pytest.approx(2.0))
    assert compute.line.endswith("1 reused trial(s) ran nothing here")
    assert compute_line(SweepCompute(), None).startswith("compute unknown")


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
    ran = compute_fields(900.0, gpus=0, cpu="1")
    for record in (
        trial(0, 0.5, **ran),
        trial(1, 0.9, reused_from=reused, **ran),
        trial(2, None, error="exit 65"),
    ):
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
    assert "| Compute | no early stopping: 1 trial(s) used 0.25 CPU-hours;" in markdown
    assert "CPU-hours |" in markdown and "| 0.2500 |" in markdown  # trial 0's column
    assert board["compute"].startswith("no early stopping: 1 trial(s)")
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
    assert (record.compute.accelerator, record.compute.compute_used, record.compute.compute_full) == (
        "cpu",
        0.25,
        0.25,
    )
    assert (record.compute.trials, record.compute.unknown, record.compute.reused) == (1, 2, 1)
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


def test_the_training_page_reads_the_sweeps_compute_from_its_trials_run_records(sweep):
    from kubetrain.sweep.records import runs_compute

    plan = sweep.plan(SPACE, early_stopping={"rule": "median", "min_trials": 1, "start_step": 1})
    dataset = {**plan["dataset"], "version": "0123456789abcdef"}
    sweep.put(sweep.location.plan_key, {**plan, "model": "flowers", "dataset": dataset})
    planned(sweep, [0, 1])
    stopped = timed(1, 600, 1, gpus=0, stopped_early=True)
    for record in (timed(0, 3600, 4, gpus=0), stopped):
        write_trial(sweep.store, "training", sweep.location.trial_record_key(record.number), record)
    context = sweep.context()
    board = operators(sweep, SweepReportOperator).execute(context)
    result = operators(sweep, RecordSweepOperator, leaderboard=board, promotion={"promoted": False}).execute(
        context
    )
    runs = [json.loads(sweep.get(uri.split("/", 3)[3])) for uri in result["run_records"]]
    assert [r["sweep"]["accelerator_hours"] for r in runs] == [pytest.approx(2.0), pytest.approx(2 / 6)]
    compute = runs_compute(runs)
    # 2 cores: 2 CPU-hours finished, 0.25 h a report and core; the stopped trial used 1/3 in 1 report
    # of the 4 the finished one made (no epochs Param): 1/3 + 3 x 0.25 x 2 at the finished one's rate
    assert (
        compute["line"]
        == board["compute"]
        == ("early stopping (median) stopped 1 of 2 trials and saved 39% of 3.8 CPU-hours (used 2.3)")
    )
    assert runs_compute([{"sweep": {"id": "s", "trial": "0"}}, {"sweep": None}]) is None


def test_an_asha_sweep_takes_the_budget_from_max_resource_and_the_leaderboard_names_the_rung():
    from kubetrain.report.sweep import SweepReportInputs, page_values
    from kubetrain_contract import EarlyStopRecord

    decision = EarlyStopRecord(
        rule="asha",
        objective="val_accuracy",
        mode="max",
        start_step=1,
        step=3,
        best=0.5,
        rung=3,
        value=0.5,
        rank=2,
        rung_trials=3,
        cutoff=0.8,
    )
    records = [timed(0, 3600, 9), timed(1, 900, 3, stopped_early=True, early_stop=decision)]
    # 9 reports at full training: the stopped trial's 0.25 h for 3 reports, plus 6 more at the
    # finished trial's 1/9 h a report, would have been 0.25 + 6/9 h
    compute = sweep_compute(records, rule="asha", fixed_params={"epochs": 4}, max_resource=9)
    assert (compute.compute_used, compute.compute_full) == (pytest.approx(1.25), pytest.approx(1.25 + 6 / 9))
    assert compute.line.startswith(
        "early stopping (asha) stopped 1 of 2 trials and saved 35% of 1.9 GPU-hours"
    )
    early = {"rule": "asha", "min_resource": 1, "reduction_factor": 3, "grace": 1, "max_resource": 9}
    values = page_values(
        SweepReportInputs(
            plan={
                "space": SPACE,
                "objective": {"metric": "val_accuracy", "mode": "max"},
                "early_stopping": early,
            },
            trials=[r.to_dict() for r in records],
            best=records[0].to_dict(),
            compute=compute,
        ),
        {},
    )
    summary = dict(values["summary"])
    assert summary["Early stopping"] == "asha, min_resource 1, reduction_factor 3, grace 1, max_resource 9"
    assert summary["Compute"] == compute.line
    assert values["header"][-2] == "GPU-hours" and values["trials"][0]["cells"][-1] == "1.0000"
    assert values["trials"][1]["cells"][-3] == "stopped early at rung 3 (report 3, rank 2 of 3)"
