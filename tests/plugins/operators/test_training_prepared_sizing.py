"""The prepared copy's room in /data: the operator's ``prepared_bytes`` grows the rendered pod's /data
``sizeLimit`` and the ephemeral-storage of the containers that hold /data, by exactly the copy's bytes."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
from kubernetes.utils.quantity import parse_quantity
from test_pod_spec import K8S_VERSION
from test_training import GI, airflow_env, build, context_for, operator, storage_of

from kubetrain.pod_sizing import MI, derived_data_size, prepared_bytes_of, size_text

# 50,000 images read at 224 px RGB: about 7 GiB of records beside a 1 GiB dataset of JPEGs
IMAGES, SIZE = 50_000, 224
PREPARED = prepared_bytes_of(IMAGES, SIZE, 3)
__all__ = ["airflow_env"]  # the fixture, from the operator's own tests


def test_the_prepared_copy_grows_the_data_volume_by_its_size(airflow_env):
    without = storage_of(build(op := operator(dataset_bytes=GI), context_for(op)))
    op = operator(dataset_bytes=GI, prepared_bytes="{{ params.prepared }}")
    pod = build(op, context_for(op, prepared=PREPARED))
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    found = storage_of(pod)

    data = derived_data_size(GI, PREPARED)
    assert PREPARED == IMAGES * (8 + SIZE * SIZE * 3)
    assert (without["data"], found["data"]) == ("3Gi", size_text(data))
    # the base container and the stage-in hold /data: each grows by the copy, rounded up to a MiB
    grown = -(-PREPARED // MI)
    for container in ("base", "stage-in"):
        before, after = (parse_quantity(s[container][0]) for s in (without, found))
        assert after - before == grown * MI, (container, without[container], found[container])
        assert found[container][0] == found[container][1]  # the limit follows the request
    # what does not hold /data is unchanged
    assert (found["checkpoints"], found["output"], found["checkpoint-sync"]) == (
        without["checkpoints"],
        without["output"],
        without["checkpoint-sync"],
    )


def test_an_unknown_prepared_copy_counts_nothing(airflow_env):
    without = storage_of(build(op := operator(dataset_bytes=GI), context_for(op)))
    for empty in ("", None, "{{ params.missing }}"):
        op = operator(dataset_bytes=GI, prepared_bytes=empty)
        assert storage_of(build(op, context_for(op, missing=None))) == without, empty


def test_a_set_data_size_is_kept_whatever_the_prepared_copy(airflow_env):
    op = operator(dataset_bytes=GI, data_size="64Gi", prepared_bytes=PREPARED)
    assert storage_of(build(op, context_for(op)))["data"] == "64Gi"


def test_a_bad_prepared_size_fails_before_any_pod_naming_the_value(airflow_env):
    op = operator(dataset_bytes=GI, prepared_bytes="{{ params.prepared }}")
    message = "prepared_bytes='7 GB' is not valid: expected the prepared copy's bytes"
    with pytest.raises(ValueError, match=re.escape(message)):
        build(op, context_for(op, prepared="7 GB"))
