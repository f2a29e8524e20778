"""The S3 lines without a cluster: the Secret (or workload identity) as the API answers it, and the lines the
sync image's probe report gives, with the fix each error calls for (test_preflight_devstack.py runs the probe
in a pod against the dev stack's S3)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from kubernetes.client import models as k8s

from kubetrain.preflight.pods import PodOutcome
from kubetrain.preflight.s3 import PROBE_PREFIX, S3Checks
from kubetrain.settings import Deployment


def secret(**data: str) -> k8s.V1Secret:
    return k8s.V1Secret(data={k: "eA==" for k in data})


def test_a_secret_with_both_keys_passes_and_says_which_optional_ones_are_absent(fake_cluster):
    checks = S3Checks(
        fake_cluster(read_namespaced_secret=secret(AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY=""))
    )
    assert checks.check_s3_secret().detail == (
        "Secret 'kubetrain-s3' has AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; no AWS_ENDPOINT_URL, "
        "AWS_DEFAULT_REGION (pods use AWS defaults)"
    )


def test_a_secret_without_a_key_fails_with_the_patch_that_adds_it(fake_cluster):
    check = S3Checks(fake_cluster(read_namespaced_secret=secret(AWS_ACCESS_KEY_ID=""))).check_s3_secret()
    assert check.status == "FAIL"
    assert check.detail == "Secret 'kubetrain-s3' lacks AWS_SECRET_ACCESS_KEY (has: AWS_ACCESS_KEY_ID)"
    assert check.fix.startswith(
        "add AWS_SECRET_ACCESS_KEY to Secret 'kubetrain-s3': kubectl -n kubetrain patch"
    )


def test_a_missing_or_unreadable_secret_fails_naming_the_fix(fake_cluster, api_error):
    missing = S3Checks(fake_cluster(read_namespaced_secret=api_error(404))).check_s3_secret()
    assert missing.detail == "Secret 'kubetrain-s3' does not exist in namespace 'kubetrain'"
    assert missing.fix.startswith("kubectl -n kubetrain create secret generic kubetrain-s3 ")
    refused = S3Checks(fake_cluster(read_namespaced_secret=api_error(403, "forbidden"))).check_s3_secret()
    assert refused.detail == "the workers may not read Secret 'kubetrain-s3': forbidden"
    assert "resourceNames of deploy/rbac.yaml's Role kubetrain-airflow" in refused.fix


@pytest.mark.parametrize(
    ("annotations", "status", "detail"),
    [
        (
            {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/t"},
            "PASS",
            "workload identity through service account 'trainer' (eks.amazonaws.com/role-arn)",
        ),
        (
            {"azure.workload.identity/client-id": "c"},
            "FAIL",
            "workload identity through service account 'trainer' (azure.workload.identity/client-id) gives pods "
            "Azure tokens",
        ),
        (None, "WARN", "workload identity: service account 'trainer' has none of the annotations"),
    ],
)
def test_workload_identity_is_read_from_the_service_accounts_annotations(
    fake_cluster, annotations, status, detail
):
    account = k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="trainer", annotations=annotations))
    deployment = Deployment(s3_secret=None, service_account="trainer")
    check = S3Checks(fake_cluster(deployment, read_namespaced_service_account=account)).check_s3_secret()
    assert check.status == status and check.detail.startswith(detail), check


def test_the_probe_command_writes_under_preflight_in_the_training_bucket(fake_cluster):
    checks = S3Checks(fake_cluster(Deployment(datasets_bucket="data", training_bucket="runs")))
    command = checks.probe_command()
    assert command[:6] == ["python", "-m", "trainer.sync", "probe", "--datasets-bucket", "data"]
    assert command[6] == "--scratch-uri" and command[7].startswith("s3://runs/preflight/")
    assert command[7] != checks.probe_command()[7]  # a fresh object each time


def ran(report: dict | None, exit_code: int = 0, before: str = "probe list: ok") -> PodOutcome:
    logs = before + ("\n" + PROBE_PREFIX + json.dumps(report) if report is not None else "")
    return PodOutcome(True, exit_code=exit_code, logs=logs)


REGION_OK = {
    "ok": True,
    "configured": "us-east-1",
    "buckets": {"datasets": "us-east-1", "training": "us-east-1"},
    "detail": "datasets in us-east-1, training in us-east-1; pods sign for us-east-1",
}
LISTED = {"ok": True, "detail": "listed datasets (1 object(s) in the first page) from http://s3:9000"}
WROTE = {"ok": True, "detail": "wrote, read back through the CRT and deleted 65536 bytes at s3://training/x"}


def lines(checks, outcome: PodOutcome) -> list[tuple[str, str, str]]:
    return [(c.name, c.status, c.detail) for c in checks.probe_checks("reg/sync:1", outcome)]


def test_a_report_of_three_good_steps_passes_three_lines(fake_cluster):
    report = {"list": LISTED, "region": REGION_OK, "write": WROTE}
    assert lines(S3Checks(fake_cluster()), ran(report)) == [
        ("s3-from-pod", "PASS", f"a pod {LISTED['detail']}"),
        ("s3-region", "PASS", REGION_OK["detail"]),
        ("s3-write", "PASS", f"a pod {WROTE['detail']}"),
    ]


def test_no_report_fails_the_first_line_with_the_pods_last_words_and_skips_the_rest(fake_cluster):
    outcome = ran(None, exit_code=2, before="usage: python -m trainer.sync\nerror: invalid choice: 'probe'\n")
    checks = S3Checks(fake_cluster()).probe_checks("reg/sync:1", outcome)
    assert [(c.name, c.status) for c in checks] == [
        ("s3-from-pod", "FAIL"),
        ("s3-region", "SKIP"),
        ("s3-write", "SKIP"),
    ]
    assert checks[0].detail == "the S3 probe in reg/sync:1 did not report: error: invalid choice: 'probe'"
    assert "rebuild and push the sync image" in checks[0].fix


def test_a_sync_image_that_did_not_run_skips_the_s3_lines(fake_cluster):
    checks = S3Checks(fake_cluster()).probe_checks("reg/sync:1", PodOutcome(False, reason="ErrImagePull"))
    assert {(c.status, c.detail) for c in checks} == {("SKIP", "needs the sync image (reg/sync:1) to run")}


@pytest.mark.parametrize(
    ("error", "deployment", "fix"),
    [
        (
            "EndpointConnectionError: Could not connect to the endpoint URL",
            Deployment(),
            "set AWS_ENDPOINT_URL in Secret 'kubetrain-s3' to an address pods reach",
        ),
        (
            "PartialCredentialsError: Partial credentials found",
            Deployment(),
            "give Secret 'kubetrain-s3' both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        ),
        (
            "NoCredentialsError: Unable to locate credentials",
            Deployment(s3_secret=None, service_account="trainer"),
            "bind service account 'trainer' to an AWS identity (IRSA)",
        ),
        (
            "NoSuchBucket: The specified bucket does not exist",
            Deployment(),
            "create bucket 'training' or set ",
        ),
        (
            "AccessDenied: Access Denied",
            Deployment(),
            "give the pods' credentials (Secret 'kubetrain-s3') s3:PutObject, s3:GetObject and s3:DeleteObject on",
        ),
        (
            "SlowDown: Please reduce your request rate",
            Deployment(),
            "check the pods' S3 credentials and endpoint",
        ),
    ],
)
def test_a_failed_write_names_the_fix_its_error_calls_for(fake_cluster, error, deployment, fix):
    report = {"list": LISTED, "region": REGION_OK, "write": {"ok": False, "detail": error}}
    write = S3Checks(fake_cluster(deployment)).probe_checks("reg/sync:1", ran(report))[2]
    assert write.status == "FAIL" and write.detail.endswith(f"in bucket 'training': {error}")
    assert write.fix.startswith(fix), write.fix


def test_a_failed_listing_names_the_datasets_bucket_and_its_setting(fake_cluster):
    listing = {"ok": False, "detail": "NoSuchBucket: The specified bucket does not exist"}
    report = {"list": listing, "region": REGION_OK, "write": WROTE}
    check = S3Checks(fake_cluster()).probe_checks("reg/sync:1", ran(report))[0]
    assert check.detail == f"a pod could not list bucket 'datasets': {listing['detail']}"
    assert check.fix == "create bucket 'datasets' or set KUBETRAIN_DATASETS_BUCKET"


def region(**buckets: str) -> dict:
    return {"ok": True, "configured": "us-east-1", "buckets": buckets, "detail": "..."}


@pytest.mark.parametrize(
    ("step", "deployment", "status", "fix"),
    [
        (
            region(datasets="eu-west-2", training="eu-west-2"),
            Deployment(),
            "FAIL",
            "kubectl -n kubetrain patch secret kubetrain-s3 --type merge -p "
            '\'{"stringData": {"AWS_REGION": "eu-west-2", "AWS_DEFAULT_REGION": "eu-west-2"}}\'',
        ),
        (
            region(datasets="eu-west-2", training="us-east-1"),
            Deployment(s3_secret=None, service_account="trainer"),
            "FAIL",
            "set AWS_REGION=eu-west-2 in the environment of service account 'trainer''s pods "
            "(or keep the buckets in us-east-1)",
        ),
        (
            region(datasets="eu-west-2", training="ap-south-1"),
            Deployment(),
            "FAIL",
            "keep the datasets and training buckets in one region, and set AWS_REGION to it",
        ),
        ({"ok": False, "detail": "AccessDenied"}, Deployment(), "WARN", ""),
    ],
)
def test_buckets_in_another_region_name_the_region_to_sign_for(fake_cluster, step, deployment, status, fix):
    report = {"list": LISTED, "region": step, "write": WROTE}
    check = S3Checks(fake_cluster(deployment)).probe_checks("reg/sync:1", ran(report))[1]
    assert (check.status, check.fix) == (status, fix), check
    if status == "FAIL":
        assert "but the pods sign for us-east-1" in check.detail


def test_the_last_report_line_counts(fake_cluster):
    old = {"list": {"ok": False, "detail": "x"}, "region": REGION_OK, "write": WROTE}
    new = {"list": LISTED, "region": REGION_OK, "write": WROTE}
    outcome = PodOutcome(True, exit_code=0, logs="\n".join(PROBE_PREFIX + json.dumps(r) for r in (old, new)))
    assert S3Checks(SimpleNamespace(deployment=Deployment())).probe_checks("i", outcome)[0].status == "PASS"
