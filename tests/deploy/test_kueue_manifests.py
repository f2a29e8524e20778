"""deploy/kueue/: the Kueue chart's values and the queues that docs/real-cluster.md installs.

queues.yaml is checked against Kueue v0.19.2's own CRD schemas (include/devstack/kubeapi/
kueue-v0.19.2-crd-schemas.json, which the dev stack's stand-in checks its queue objects against; the served
versions' openAPIV3Schema from Kueue's release source), strictly: a field Kueue does not know is an error, as
`kubectl apply` (strict field validation) makes it. The dev stack's Kueue stand-in starts with these
objects (include/devstack/kueue.yaml applies this file), so what the tests queue against is what a cluster
gets. values.yaml restates the chart's default and enables the integration of every job kind kubetrain
queues. Kueue's CEL rules (x-kubernetes-validations) are not evaluated here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from include.devstack.kubeapi.openapi import KUEUE_CRD_SCHEMAS, closed_schema
from kubetrain.operators.distributed import KUEUE_FRAMEWORKS
from kubetrain.settings import SETTINGS

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = json.loads(KUEUE_CRD_SCHEMAS.read_text())["kinds"]
# the top-level keys of the v0.19.2 chart's default manager configuration, which the values replace wholesale
CHART_DEFAULT_KEYS = {
    "apiVersion",
    "kind",
    "health",
    "metrics",
    "webhook",
    "leaderElection",
    "controller",
    "clientConnection",
    "integrations",
}


def validate(doc: dict) -> None:
    group, _, version = doc["apiVersion"].partition("/")
    assert group == "kueue.x-k8s.io", doc["apiVersion"]
    versions = SCHEMAS[doc["kind"]]
    assert version in versions, f"{doc['kind']} {version} is not served by Kueue v0.19.2: {sorted(versions)}"
    # unknown fields refused wherever the schema lists an object's fields, as strict field validation does
    jsonschema.validate(doc, closed_schema(versions[version]))


@pytest.fixture(scope="module")
def queues() -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / "deploy" / "kueue" / "queues.yaml").read_text()) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_every_queue_object_is_valid_for_kueue_0_19(queues):
    assert {d["kind"] for d in queues} == {
        "ResourceFlavor",
        "ClusterQueue",
        "LocalQueue",
        "WorkloadPriorityClass",
    }
    for doc in queues:
        validate(doc)
    # v1beta2, the version Kueue v0.19 stores
    assert {d["apiVersion"] for d in queues} == {"kueue.x-k8s.io/v1beta2"}


@pytest.mark.parametrize(
    ("kind", "change"),
    [
        # v1beta1's name of the cohort field, gone in v1beta2
        ("ClusterQueue", lambda d: d["spec"].update(cohort="team")),
        ("ClusterQueue", lambda d: d["spec"].update(queueingStrategy="FIFO")),
        ("ClusterQueue", lambda d: d["spec"]["resourceGroups"][0]["flavors"][0].update(quota=[])),
        ("LocalQueue", lambda d: d["spec"].update(clusterqueue="kubetrain")),
        ("WorkloadPriorityClass", lambda d: d.update(value="high")),
    ],
)
def test_the_check_refuses_what_kueue_refuses(queues, kind, change):
    doc = copy.deepcopy(by_kind(queues, kind)[0])
    change(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def test_the_queues_hold_together_and_cover_what_training_pods_ask_for(queues):
    (flavor,) = by_kind(queues, "ResourceFlavor")
    (cluster_queue,) = by_kind(queues, "ClusterQueue")
    (local_queue,) = by_kind(queues, "LocalQueue")
    namespace = SETTINGS["namespace"].default
    assert local_queue["metadata"]["namespace"] == namespace
    assert local_queue["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"]
    assert cluster_queue["spec"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": namespace
    }
    (group,) = cluster_queue["spec"]["resourceGroups"]
    assert {f["name"] for f in group["flavors"]} == {flavor["metadata"]["name"]}
    # what a training pod requests: its containers' cpu, memory and GPU, and its emptyDirs' disk
    assert set(group["coveredResources"]) == {"cpu", "memory", "nvidia.com/gpu", "ephemeral-storage"}
    for f in group["flavors"]:
        assert {r["name"] for r in f["resources"]} == set(group["coveredResources"])


def test_the_dev_stack_starts_with_these_queues_sized_to_its_one_gpu():
    from include.devstack.kubeapi.kueue import manifest_objects
    from include.devstack.stack import KUEUE_CONFIG

    config = yaml.safe_load(KUEUE_CONFIG.read_text())
    assert "clusterQueues" not in config and "localQueues" not in config, "one source of queues"
    (applied,) = config["apply"]["files"]
    assert (KUEUE_CONFIG.parent / applied).resolve() == REPO / "deploy" / "kueue" / "queues.yaml"
    # what the stand-in creates is this file, but for the GPU quota (the dev stack has one GPU)
    assert config["apply"]["nominalQuota"] == {"nvidia.com/gpu": "1"}
    (cluster_queue,) = by_kind(manifest_objects(config, KUEUE_CONFIG.parent), "ClusterQueue")
    for resource in cluster_queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"]:
        if resource["name"] == "nvidia.com/gpu":
            assert resource["nominalQuota"] == "1"
    validate(cluster_queue)


def test_the_chart_values_restate_the_default_and_enable_what_kubetrain_queues():
    values = yaml.safe_load((REPO / "deploy" / "kueue" / "values.yaml").read_text())
    assert set(values) == {"managerConfig"}
    config = yaml.safe_load(values["managerConfig"]["controllerManagerConfigYaml"])
    assert config["apiVersion"] == "config.kueue.x-k8s.io/v1beta2" and config["kind"] == "Configuration"
    missing = CHART_DEFAULT_KEYS - set(config)
    assert not missing, f"the chart replaces its default wholesale: {sorted(missing)} would be lost"
    assert config["health"]["healthProbeBindAddress"] == ":8081"  # the chart's probes target it
    frameworks = config["integrations"]["frameworks"]
    # single runs and sweep trials are plain pods; multi-worker runs are the backends' job kinds
    needed = {"pod", *KUEUE_FRAMEWORKS.values()}
    assert needed <= set(frameworks), sorted(needed - set(frameworks))
    # gangs that cannot all be scheduled give their quota back
    assert config["waitForPodsReady"]["timeout"]
    selector = config["managedJobsNamespaceSelector"]["matchExpressions"]
    assert {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": ["kube-system", "kueue-system"],
    } in (selector)


def test_the_airflow_chart_values_queue_in_the_local_queue(queues):
    values = yaml.safe_load((REPO / "deploy" / "helm" / "values.yaml").read_text())
    env = {e["name"]: e["value"] for e in values["env"]}
    (local_queue,) = by_kind(queues, "LocalQueue")
    assert env["KUBETRAIN_QUEUE"] == local_queue["metadata"]["name"]
    assert env["KUBETRAIN_NAMESPACE"] == local_queue["metadata"]["namespace"]
