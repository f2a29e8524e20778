"""Where the prepared copies of a staged dataset version live: beside its snapshot, in the training bucket."""

from __future__ import annotations

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.s3_layout import S3Layout, check_dataset_source, prepared_uri_of


def test_the_prepared_prefix_is_beside_the_snapshot_manifest():
    layout = S3Layout(training_bucket="ml-training")
    manifest = layout.manifest_uri("pets", "0123456789abcdef")
    assert manifest == "s3://ml-training/manifests/pets/0123456789abcdef.json"
    assert (
        layout.prepared_uri("pets", "0123456789abcdef") == "s3://ml-training/prepared/pets/0123456789abcdef/"
    )
    assert prepared_uri_of(manifest) == layout.prepared_uri("pets", "0123456789abcdef")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: S3Layout().prepared_uri("Pets/..", "0123456789abcdef"),
            "dataset name 'Pets/..' is not valid",
        ),
        (lambda: S3Layout().prepared_uri("pets", "latest"), "dataset version 'latest' is not valid"),
        (
            lambda: prepared_uri_of("s3://training/runs/x/manifest.json"),
            "is not a staged snapshot's: expected s3://<training bucket>/manifests/<dataset>/<version>.json",
        ),
        (
            lambda: prepared_uri_of("s3://training/manifests/pets/v1.json"),
            "dataset version 'v1' is not valid",
        ),
    ],
)
def test_bad_names_are_refused_naming_them(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


def test_the_prepared_area_is_never_a_dataset():
    with pytest.raises(ValueError, match="kubetrain's own area of the training bucket"):
        check_dataset_source(
            "s3://training/prepared/pets/0123456789abcdef/",
            allowed=["s3://training/"],
            training_bucket="training",
        )
