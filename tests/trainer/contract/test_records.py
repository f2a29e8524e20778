"""The contract's versioned records: reading, writing, refusing, and the schema files that match them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from kubetrain_contract import RECORDS, EarlyStopRecord
from kubetrain_contract.records import SCHEMA_DIR, Record, RecordError, schema_text, spec

CONTRACT = Path(__file__).resolve().parents[3] / "trainer"


@dataclass(frozen=True)
class Part:
    """A nested object."""

    name: str
    size: int = spec(minimum=0)


@dataclass(frozen=True)
class Sample(Record):
    """A record for the tests."""

    KIND = "kubetrain/sample"
    SCHEMA_NAME = "sample"

    number: int = spec(json_name="pass", minimum=1)
    ratio: float
    tags: list[str]
    parts: list[Part]
    mode: Literal["max", "min"]
    extra: dict[str, Any] = field(default_factory=dict)
    note: str | None = None


def sample() -> Sample:
    return Sample(number=3, ratio=0.5, tags=["a"], parts=[Part("x", 2)], mode="max", extra={"k": [1]})


def test_a_record_round_trips_with_its_header_first() -> None:
    record = sample()
    doc = json.loads(record.to_json())
    assert list(doc)[:3] == ["kind", "format_version", "pass"]
    assert doc["parts"] == [{"name": "x", "size": 2}]
    assert Sample.from_json(record.to_json()) == record


def test_an_integer_is_read_as_a_float_field_and_optional_fields_may_be_absent() -> None:
    doc = sample().to_dict()
    doc["ratio"] = 1
    del doc["note"], doc["extra"]
    record = Sample.from_dict(doc)
    assert record.ratio == 1.0 and isinstance(record.ratio, float) and record.note is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "kubetrain/other"}, "unknown kind 'kubetrain/other', expected 'kubetrain/sample'"),
        ({"format_version": 2}, "unknown format_version 2 of kubetrain/sample"),
        ({"pass": True}, "field 'pass' is True, expected an integer"),
        ({"pass": 0}, "field 'pass' is 0, expected at least 1"),
        ({"ratio": "0.5"}, "field 'ratio' is '0.5', expected a number"),
        ({"tags": ["a", 2]}, "field 'tags[1]' is 2, expected a string"),
        ({"parts": [{"name": "x", "size": -1}]}, "field 'parts[0].size' is -1, expected at least 0"),
        ({"parts": [{"size": 1}]}, "field 'parts[0].name' is missing, expected a string"),
        ({"mode": "best"}, "field 'mode' is 'best', expected one of 'max', 'min'"),
        ({"note": 5}, "field 'note' is 5, expected a string or null"),
    ],
)
def test_a_bad_document_is_refused_naming_the_field_the_value_and_what_was_expected(
    change: dict[str, Any], message: str
) -> None:
    doc = sample().to_dict() | change
    with pytest.raises(RecordError) as caught:
        Sample.from_dict(doc, where="s3://training/x.json")
    assert str(caught.value).startswith("s3://training/x.json: ")
    assert message in str(caught.value)


def test_text_that_is_not_json_or_not_an_object_is_refused() -> None:
    with pytest.raises(RecordError, match="not valid JSON"):
        Sample.from_json(b"{torn")
    with pytest.raises(RecordError, match="expected a JSON object"):
        Sample.from_json(b"[1]")


def test_a_record_refuses_nan_when_written() -> None:
    record = Sample(number=1, ratio=float("nan"), tags=[], parts=[], mode="min")
    with pytest.raises(ValueError):
        record.to_json()


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.SCHEMA_NAME)
def test_each_schema_file_is_the_one_its_record_generates(record: type[Record]) -> None:
    path = SCHEMA_DIR / record.schema_file()
    assert path.read_text() == schema_text(record), (
        f"regenerate {path.name}: python -m kubetrain_contract --write"
    )


def test_the_schema_check_command_names_a_stale_file(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "kubetrain_contract"], cwd=CONTRACT, capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    copy = tmp_path / "kubetrain_contract"
    subprocess.run(["cp", "-r", str(CONTRACT / "kubetrain_contract"), str(copy)], check=True)
    stale = copy / "schemas" / EarlyStopRecord.schema_file()
    stale.write_text(stale.read_text().replace("median", "mean"))
    failed = subprocess.run(
        [sys.executable, "-m", "kubetrain_contract"], cwd=tmp_path, capture_output=True, text=True
    )
    assert failed.returncode == 1
    assert "early-stop.v1.json" in failed.stderr and "--write" in failed.stderr


def test_the_early_stop_record_reads_what_the_sidecar_writes() -> None:
    record = EarlyStopRecord(
        rule="median",
        objective="val_accuracy",
        mode="max",
        start_step=4,
        min_trials=3,
        step=5,
        best=0.4,
        median=0.6,
        finished_trials=3,
    )
    again = EarlyStopRecord.from_json(record.to_json())
    assert again == record and again.decided_at.endswith("Z")
