"""PodLogFollower: each pod log line reaches the task log once, however the reads overlap."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from kubetrain.triggers.pod import PodLogFollower


@pytest.fixture
def follower() -> PodLogFollower:
    return PodLogFollower(async_hook=None, containers=["stage-in", "checkpoint-sync"])


def logged(follower: PodLogFollower, container: str, lines: list[str]) -> list[str]:
    with capture_logs() as entries:
        follower._log_lines(container, lines)
    return [e["event"] for e in entries]


def test_overlapping_reads_log_each_line_once(follower):
    first = ["2026-11-22T04:00:01.5Z step 1", "2026-11-22T04:00:02.25Z step 2"]
    assert logged(follower, "base", first) == ["[base] step 1", "[base] step 2"]
    # The next read starts before the last line (clock skew margin): only the new lines are logged.
    again = [*first, "2026-11-22T04:00:03Z step 3"]
    assert logged(follower, "base", again) == ["[base] step 3"]
    assert logged(follower, "base", again) == []


def test_lines_with_the_same_timestamp_are_counted_not_dropped(follower):
    same = "2026-11-22T04:00:05.000000001Z"
    assert logged(follower, "base", [f"{same} a", f"{same} b"]) == ["[base] a", "[base] b"]
    # Re-read with one more line at that instant: the two seen ones are skipped, the third is new.
    assert logged(follower, "base", [f"{same} a", f"{same} b", f"{same} c"]) == ["[base] c"]


def test_each_container_keeps_its_own_place(follower):
    assert logged(follower, "stage-in", ["2026-11-22T04:00:09Z stage-in: done"]) == [
        "[stage-in] stage-in: done"
    ]
    # The base container started earlier than the stage-in's last line was read: its lines still come.
    assert logged(follower, "base", ["2026-11-22T04:00:01Z starting"]) == ["[base] starting"]


def test_continuation_lines_follow_the_line_they_belong_to(follower):
    lines = ["2026-11-22T04:00:01Z Traceback (most recent call last):", '  File "train.py", line 3']
    assert logged(follower, "base", lines) == [
        "[base] Traceback (most recent call last):",
        '[base]   File "train.py", line 3',
    ]
    # A continuation of a line logged before is not logged again.
    assert logged(follower, "base", lines) == []


def test_the_containers_lines_of_one_read_come_in_the_order_they_were_written(follower):
    # The pod ended: the last read has the trainer's last epoch and then the sidecar's final pass,
    # each container's lines in its own order, merged by their stamps (not container by container).
    reads = {
        "checkpoint-sync": [
            "2026-11-22T04:00:02Z pass 7: 3 files",
            "2026-11-22T04:00:06Z final pass: 4 files",
            "2026-11-22T04:00:06Z done",
        ],
        "base": [
            "2026-11-22T04:00:01Z Epoch 3/3",
            "2026-11-22T04:00:05Z Traceback (most recent call last):",
            '  File "train.py", line 3',
            "2026-11-22T04:00:06Z exit",
        ],
    }
    with capture_logs() as entries:
        assert follower._log_merged(reads) == 6
    assert [e["event"] for e in entries] == [
        "[base] Epoch 3/3",
        "[checkpoint-sync] pass 7: 3 files",
        "[base] Traceback (most recent call last):",
        '[base]   File "train.py", line 3',
        "[checkpoint-sync] final pass: 4 files",
        "[checkpoint-sync] done",
        "[base] exit",
    ]
    # the next read overlaps: nothing is logged twice
    with capture_logs() as entries:
        assert follower._log_merged(reads) == 0
    assert entries == []
