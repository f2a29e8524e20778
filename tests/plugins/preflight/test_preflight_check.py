"""The preflight's line (Check) and how a check that raised becomes one FAIL line (guarded)."""

from __future__ import annotations

import pytest

from kubetrain.preflight.check import Check, api_message, guarded, short_error


def test_a_line_reads_status_name_detail_and_the_fix_of_a_fail():
    assert Check("api", "PASS", "API v1.31 answers").line() == "PASS  api: API v1.31 answers"
    assert (
        Check("registry", "FAIL", "does not answer", "define connection r").line()
        == "FAIL  registry: does not answer -> fix: define connection r"
    )


def test_a_status_outside_the_five_is_refused_naming_them():
    with pytest.raises(
        ValueError, match=r"invalid status 'OK': expected one of PASS, FAIL, WARN, INFO, SKIP"
    ):
        Check("api", "OK", "x")


@pytest.mark.parametrize(
    ("raised", "status", "detail", "fix"),
    [
        (None, "PASS", "fine", ""),
        (
            (403, 'secrets "x" is forbidden'),
            "FAIL",
            'the API refused: 403 secrets "x" is forbidden',
            "see the access line: kubectl apply -f deploy/rbac.yaml",
        ),
        (
            (500, "etcd timeout"),
            "FAIL",
            "the API refused: 500 etcd timeout",
            "check the cluster's API server",
        ),
        (
            RuntimeError("boom\nsecond line"),
            "FAIL",
            "could not be checked: RuntimeError: boom",
            "check the settings and the cluster",
        ),
    ],
)
def test_guarded_turns_what_a_check_raises_into_one_fail_line(api_error, raised, status, detail, fix):
    def check() -> Check:
        if raised is None:
            return Check("queue", "PASS", "fine")
        raise api_error(*raised) if isinstance(raised, tuple) else raised

    assert guarded("queue", check) == Check("queue", status, detail, fix)


def test_api_message_reads_the_status_body_or_its_first_line(api_error):
    assert api_message(api_error(404, 'namespaces "x" not found')) == 'namespaces "x" not found'
    plain = api_error(502, reason="Bad Gateway")
    plain.body = b"<html>bad gateway</html>\nmore"
    assert api_message(plain) == "<html>bad gateway</html>"


def test_short_error_is_the_type_and_first_line_within_300_characters():
    assert short_error(OSError("refused\ntraceback...")) == "OSError: refused"
    assert len(short_error(ValueError("x" * 1000))) == 300
