"""The run record's disruptions: preemptions, time queued and steps lost, from the training task's XCom
``disruptions`` and the interrupted pods' last sync passes."""

from __future__ import annotations

from datetime import UTC, datetime

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.run_record import RunFacts, build_record
from kubetrain.s3_layout import S3Layout
from kubetrain_contract.run import RunRecord

RUN = S3Layout("training").run("train_image_classifier", "manual__1")


def facts(disruptions, checkpoints=None) -> RunFacts:
    return RunFacts(
        dag_id="train_image_classifier",
        run_id="manual__1",
        run=RUN,
        run_time=datetime(2026, 3, 2, 8, tzinfo=UTC),
        model="digits",
        disruptions=disruptions,
        checkpoints=checkpoints,
    )


def interruption(pod: str, exit_code: int | None, queued_s: float | None = None) -> dict:
    return {
        "pod": pod,
        "reason": f"pod {pod}: TerminationTarget: WorkloadEvictedDueToPreempted",
        "at": "2026-03-02T08:10:00+00:00",
        "queued_s": queued_s,
        "exit_code": exit_code,
    }


def test_a_run_the_cluster_never_queued_or_interrupted_has_no_disruptions():
    assert build_record(facts(None)).disruptions is None
    assert build_record(facts({"interruptions": [], "queued_s": 0.0})).disruptions is None


def test_preemptions_time_queued_and_steps_lost_are_counted():
    record = build_record(
        facts(
            {
                "interruptions": [interruption("p-1", 75, queued_s=12.5), interruption("p-2", 75)],
                "queued_s": 40.25,
            },
            # p-1's final pass kept its SIGTERM checkpoint; so did p-2's
            {"p-1": (120, True), "p-2": (300, True)},
        )
    )
    d = record.disruptions
    assert (d.preemptions, d.queued_s, d.steps_lost) == (2, 40.25, 0)
    assert [(i.pod, i.resume_step, i.steps_lost, i.queued_s) for i in d.interruptions] == [
        ("p-1", 120, 0, 12.5),
        ("p-2", 300, 0, None),
    ]
    # the record round-trips through its schema-checked JSON
    assert RunRecord.from_json(record.to_json()).disruptions == d


@pytest.mark.parametrize(
    ("exit_code", "checkpoint", "why"),
    [
        (143, (120, True), "SIGTERM not handled: what it trained since step 120 is lost, and only it knows"),
        (None, (120, True), "the pod was gone before its exit code was seen"),
        (75, (120, False), "its sidecar's shutdown pass did not finish"),
        (75, None, "no pass of the pod"),
    ],
)
def test_steps_lost_are_unknown_unless_the_container_checkpointed_on_sigterm_and_it_was_kept(
    exit_code, checkpoint, why
):
    record = build_record(
        facts(
            {"interruptions": [interruption("p-1", exit_code)], "queued_s": 0},
            {"p-1": checkpoint} if checkpoint else {},
        )
    )
    d = record.disruptions
    assert d.preemptions == 1, why
    assert d.interruptions[0].steps_lost is None, why
    assert d.steps_lost is None, why
    assert d.interruptions[0].resume_step == (checkpoint[0] if checkpoint else None), why


def test_time_queued_alone_is_recorded():
    d = build_record(facts({"interruptions": [], "queued_s": 95.0})).disruptions
    assert (d.preemptions, d.queued_s, d.steps_lost, d.interruptions) == (0, 95.0, 0, [])


def test_the_report_counts_preemptions_time_queued_and_steps_lost():
    from kubetrain.report.render import disruption_rows

    d = build_record(
        facts(
            {"interruptions": [interruption("p-1", 75), interruption("p-2", 137)], "queued_s": 200.4},
            {"p-1": (120, True), "p-2": (300, False)},
        )
    ).disruptions
    assert disruption_rows(d) == [
        ("Time queued", "3 min 20 s"),
        ("Preemptions", "2 (no retry used; resumed at step 120, 300; steps lost: not known)"),
    ]
    assert disruption_rows(None) == []
