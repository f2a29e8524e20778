"""The contract's helpers both sides use: S3 URIs, strict-JSON values and the run layout's keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kubetrain_contract.json_values import json_safe
from kubetrain_contract.run_layout import PASS_NAME, SYNC_AREA, pass_key, pass_number, pass_prefix
from kubetrain_contract.s3uri import S3Uri, check_bucket, parse_s3_uri


@pytest.mark.parametrize(
    ("uri", "bucket", "key"),
    [
        ("s3://training/runs/d/r", "training", "runs/d/r"),
        ("s3://training/runs/d/r/", "training", "runs/d/r/"),
        ("s3://training", "training", ""),
        ("s3://my.data-1/x", "my.data-1", "x"),
    ],
)
def test_an_s3_uri_parses_into_its_bucket_and_key(uri: str, bucket: str, key: str) -> None:
    parsed = parse_s3_uri(uri)
    assert parsed == S3Uri(bucket, key)
    assert tuple(parsed) == (bucket, key)
    assert str(parsed) == f"s3://{bucket}/{key}"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("https://x/y", "KUBETRAIN_RUN_URI 'https://x/y' is not an S3 URI: expected s3://<bucket>/"),
        (None, "KUBETRAIN_RUN_URI None is not an S3 URI"),
        ("s3:///key", "KUBETRAIN_RUN_URI 's3:///key': bucket name '' is not valid"),
        ("s3://Training/x", "KUBETRAIN_RUN_URI 's3://Training/x': bucket name 'Training' is not valid"),
        ("s3://a..b/x", "bucket name 'a..b' is not valid: expected 3-63 characters"),
        ("s3://ab/x", "bucket name 'ab' is not valid"),
    ],
)
def test_a_bad_s3_uri_is_refused_naming_the_value(uri: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_s3_uri(uri, "KUBETRAIN_RUN_URI")  # type: ignore[arg-type]
    assert message in str(info.value)


def test_check_bucket_returns_a_valid_name_and_refuses_others() -> None:
    assert check_bucket("training") == "training"
    with pytest.raises(ValueError, match="bucket name 'x_y' is not valid"):
        check_bucket("x_y")


def test_join_puts_parts_below_the_key() -> None:
    assert S3Uri("b", "runs/d/").join("sync", "pass.json") == S3Uri("b", "runs/d/sync/pass.json")
    assert S3Uri("b", "").join("a", "b") == S3Uri("b", "a/b")


def test_json_safe_makes_values_strict_json() -> None:
    numpy = pytest.importorskip("numpy")
    value = {
        "nan": float("nan"),
        "inf": [math.inf, -math.inf, 1.5],
        1: (True, None, "x"),
        "np": [numpy.float32(0.5), numpy.int64(7), numpy.float64("nan")],
        "path": Path("/output/model"),
    }
    safe = json_safe(value)
    assert safe == {
        "nan": None,
        "inf": [None, None, 1.5],
        "1": [True, None, "x"],
        "np": [0.5, 7, None],
        "path": "/output/model",
    }
    assert type(safe["np"][1]) is int
    json.dumps(safe, allow_nan=False)


def test_the_pass_key_is_written_and_read_back_in_one_place() -> None:
    assert pass_key("runs/d/r/", 3) == "runs/d/r/sync/pass-00000003.json"
    assert pass_key("runs/d/r", 12) == f"runs/d/r/{SYNC_AREA}/pass-00000012.json"
    assert pass_number(pass_key("runs/d/r", 99_999_999)) == 99_999_999
    assert pass_key("runs/d/r", 7).startswith(pass_prefix("runs/d/r/"))
    assert pass_number("runs/d/r/sync/notes.json") is None
    assert pass_number("runs/d/r/sync/xpass-00000001.json") is None
    assert PASS_NAME.search("pass-00000004.json").group(1) == "00000004"


@pytest.mark.parametrize("number", [-1, 100_000_000, 1.0, "3", True])
def test_a_pass_number_out_of_range_is_refused(number: object) -> None:
    with pytest.raises(ValueError, match=f"sync pass number {number!r} is not valid: expected an integer"):
        pass_key("runs/d/r", number)  # type: ignore[arg-type]
