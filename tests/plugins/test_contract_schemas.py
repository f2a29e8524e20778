"""The contract records' generated JSON Schemas, checked with jsonschema (which the Airflow side has)."""

from __future__ import annotations

import jsonschema

from kubetrain_contract import RECORDS, EarlyStopRecord


def test_each_generated_schema_is_a_valid_schema() -> None:
    for record in RECORDS:
        jsonschema.Draft202012Validator.check_schema(record.json_schema())


def test_the_early_stop_schema_accepts_what_the_record_writes_and_refuses_what_it_refuses() -> None:
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
    validator = jsonschema.Draft202012Validator(EarlyStopRecord.json_schema())
    doc = record.to_dict()
    validator.validate(doc)
    for bad in ({"step": 0}, {"mode": "best"}, {"best": "0.4"}, {"kind": "x"}, {"format_version": 2}):
        assert not validator.is_valid(doc | bad), bad
    missing = dict(doc)
    del missing["objective"]
    assert not validator.is_valid(missing)
