"""Progress lines of the transfer tool: what a pod log shows while objects arrive, and the summary."""

from __future__ import annotations

import re
import time

from trainer.sync.progress import Progress, human_bytes, human_seconds

LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ stage-in: (?P<done>\d+)/10 objects, [\d.]+ (?:B|kB|MB)/5\.0 MB, "
    r"[\d.]+ (?:B|kB|MB)/s, ETA (?P<eta>\S+)$"
)


def test_lines_come_at_the_interval_and_count_what_is_done(capsys):
    progress = Progress("stage-in", total_objects=10, total_bytes=5_000_000, interval=0.05)
    progress.add(objects=1, nbytes=250_000)  # before the first line can be due
    with progress:
        for _ in range(3):
            time.sleep(0.1)
            progress.add(objects=1, nbytes=250_000)
        time.sleep(0.1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2, lines  # 0.4 s at a 0.05 s interval
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    done = [int(m["done"]) for m in parsed]
    assert done == sorted(done) and 1 <= done[0] and done[-1] <= 4
    assert all(m["eta"] != "-" for m in parsed)  # bytes remain and arrive: an ETA is given
    last = Progress("stage-in", 10, 5_000_000, 0)
    last.add(objects=10, nbytes=5_000_000)
    assert last.line().endswith("ETA -")  # nothing left
    summary = progress.summary(" from S3")
    assert re.fullmatch(
        r"stage-in: done: 4 objects, 1\.0 MB in [\d.]+s \([\d.]+ (kB|MB)/s\) from S3", summary
    )


def test_interval_zero_writes_no_lines(capsys):
    with Progress("restore", 1, 1, interval=0) as progress:
        progress.add(objects=1, nbytes=1)
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_human_units():
    assert [human_bytes(n) for n in (999, 1000, 1_234_567, 5e9, 7e15)] == [
        "999 B",
        "1.0 kB",
        "1.2 MB",
        "5.0 GB",
        "7000.0 TB",
    ]
    assert [human_seconds(s) for s in (4.24, 65, 3725)] == ["4.2s", "1m05s", "1h02m"]
