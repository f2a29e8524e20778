"""Pure functions of the local Kubernetes API: selectors, patches, $(VAR) expansion, path remapping, formats."""

from __future__ import annotations

import re

import pytest

from include.devstack.kubeapi import meta, patch, runtime, selectors
from include.devstack.kubeapi.images import ImageMap, ImageMapError
from include.devstack.kubeapi.jobs import format_indexes
from include.devstack.kubeapi.logs import LogFile, LogOptions, read_entries
from include.devstack.kubeapi.validation import parse_quantity

POD = {"metadata": {"name": "p", "namespace": "default", "labels": {"app": "web", "tier": "front", "n": "5"}}}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("", True),
        ("app=web", True),
        ("app==web", True),
        ("app!=web", False),
        ("app=db", False),
        ("app in (db, web)", True),
        ("app notin (web)", False),
        ("app notin (db)", True),
        ("tier", True),
        ("!tier", False),
        ("!missing", True),
        ("missing", False),
        ("app=web,tier=front", True),
        ("app=web,tier!=front", False),
        ("missing!=x", True),  # != matches objects without the key, as in apimachinery
        ("n>4", True),
        ("n<4", False),
    ],
)
def test_label_selector(selector, expected):
    assert selectors.parse_label_selector(selector)(POD) is expected


def test_label_selector_syntax_error_names_the_selector():
    with pytest.raises(meta.ApiError) as err:
        selectors.parse_label_selector("app in web")
    assert err.value.code == 400 and "app in web" in err.value.message


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("metadata.name=p", True),
        ("metadata.name!=p", False),
        ("metadata.namespace==default", True),
        ("status.phase=Running", True),
        ("status.phase=Running,spec.nodeName=kubetrain-dev", True),
        ("spec.nodeName=other", False),
    ],
)
def test_field_selector(selector, expected):
    pod = {**POD, "spec": {"nodeName": "kubetrain-dev"}, "status": {"phase": "Running"}}
    assert selectors.parse_field_selector("pods", selector)(pod) is expected


def test_unknown_field_selector_is_a_bad_request():
    with pytest.raises(meta.ApiError) as err:
        selectors.parse_field_selector("pods", "spec.bogus=1")
    assert err.value.code == 400 and "spec.bogus" in err.value.message


def test_strategic_merge_patch_merges_lists_by_key_and_deletes():
    target = {
        "metadata": {"labels": {"a": "1", "b": "2"}},
        "spec": {
            "containers": [
                {"name": "x", "image": "i1", "env": [{"name": "E", "value": "1"}]},
                {"name": "y", "image": "i2"},
            ]
        },
    }
    out = patch.strategic_merge(
        target,
        {
            "metadata": {"labels": {"a": None, "c": "3"}},
            "spec": {
                "containers": [
                    {"name": "x", "env": [{"name": "F", "value": "2"}]},
                    {"name": "y", "$patch": "delete"},
                ]
            },
        },
    )
    assert out["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert out["spec"]["containers"] == [
        {"name": "x", "image": "i1", "env": [{"name": "E", "value": "1"}, {"name": "F", "value": "2"}]}
    ]
    assert target["metadata"]["labels"] == {"a": "1", "b": "2"}  # the input is untouched


def test_merge_patch_replaces_lists_and_removes_nulls():
    out = patch.merge_patch({"a": {"b": 1, "c": 2}, "l": [1, 2]}, {"a": {"b": None}, "l": [3]})
    assert out == {"a": {"c": 2}, "l": [3]}


def test_json_patch_operations_and_failed_test():
    doc = {"metadata": {"labels": {"a/b": "1"}}, "list": [1, 2]}
    out = patch.json_patch(
        doc,
        [
            {"op": "add", "path": "/metadata/labels/c", "value": "3"},
            {"op": "remove", "path": "/metadata/labels/a~1b"},
            {"op": "add", "path": "/list/-", "value": 3},
            {"op": "replace", "path": "/list/0", "value": 0},
            {"op": "copy", "from": "/list/0", "path": "/first"},
        ],
    )
    assert out == {"metadata": {"labels": {"c": "3"}}, "list": [0, 2, 3], "first": 0}
    with pytest.raises(meta.ApiError) as err:
        patch.json_patch(doc, [{"op": "test", "path": "/list/0", "value": 9}])
    assert err.value.code == 422


def test_unsupported_patch_type_is_415():
    with pytest.raises(meta.ApiError) as err:
        patch.apply_patch("application/apply-patch+yaml", {}, {})
    assert err.value.code == 415


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)/x", "1/x"),
        ("$$(A)", "$(A)"),
        ("$(MISSING)", "$(MISSING)"),
        ("$A $(A", "$A $(A"),
        ("a$(A)b$(B)", "a1b2"),
    ],
)
def test_dependent_variable_expansion(text, expected):
    assert runtime.expand(text, {"A": "1", "B": "2"}) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/data/x.txt", "/host/vol/x.txt"),
        ("--dir=/data", "--dir=/host/vol"),
        ("/data2/x", "/data2/x"),
        ("/mnt/data/x", "/mnt/data/x"),
        ("cat /airflow/xcom/return.json", "cat /host/xcom/return.json"),
    ],
)
def test_mount_path_remapping(text, expected):
    remap = runtime.Remapper({"/data": "/host/vol", "/airflow/xcom": "/host/xcom"})
    assert remap(text) == expected


def test_exec_guard_points_pid_1_at_the_container():
    argv, prefix = runtime.guard_exec_argv(["kill", "-s", "SIGINT", "1"], 4242)
    assert argv == ["kill", "-s", "SIGINT", "4242"] and prefix == b""
    argv, prefix = runtime.guard_exec_argv(["/bin/sh"], 4242)
    assert argv == ["/bin/sh"] and b"pgrep -g 4242" in prefix


@pytest.mark.parametrize(
    ("ns", "expected"),
    [
        (1_700_000_000_000_000_000, "2023-11-14T22:13:20Z"),
        (1_700_000_000_120_000_000, "2023-11-14T22:13:20.12Z"),
        (1_700_000_000_000_000_001, "2023-11-14T22:13:20.000000001Z"),
    ],
)
def test_rfc3339_nano_trims_zeros_like_go(ns, expected):
    assert meta.rfc3339_nano(ns) == expected
    assert abs(meta.parse_time(expected) - ns / 1e9) < 1e-6


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(5, "5s"), (150, "2m30s"), (600, "10m"), (4000, "66m"), (40000, "11h"), (200000, "2d7h")],
)
def test_human_duration(seconds, text):
    assert meta.human_duration(seconds) == text


@pytest.mark.parametrize(("indexes", "text"), [({0, 1, 2}, "0-2"), ({0, 2, 3, 5}, "0,2-3,5"), (set(), "")])
def test_completed_indexes_notation(indexes, text):
    assert format_indexes(indexes) == text


@pytest.mark.parametrize(
    ("q", "value"), [("500m", "0.5"), ("2Gi", str(2 * 2**30)), ("1", "1"), ("1.5k", "1500")]
)
def test_quantities(q, value):
    assert parse_quantity(q) == parse_quantity(value)


def test_image_map_first_match_wins_and_short_forms(tmp_path):
    path = tmp_path / "images.json"
    path.write_text(
        '{"runtimes": {"a": {"path": ["{repo}/bin"], "command": ["x"]}, "b": {}},'
        ' "images": [{"pattern": "alpine[:@]*", "runtime": "a"}, {"pattern": "*", "runtime": "b"}]}'
    )
    imap = ImageMap(path)
    assert imap.resolve("docker.io/library/alpine:3.20").runtime == "a"
    assert imap.resolve("alpine:3.20").command == ("x",)
    assert imap.resolve("quay.io/other:1").runtime == "b"
    path.write_text('{"runtimes": {}, "images": [{"pattern": "*", "runtime": "missing"}]}')
    with pytest.raises(ImageMapError, match="images\\[0\\]"):
        imap.resolve("x")


def test_project_image_map_covers_the_documented_images():
    imap = ImageMap(meta_path())
    for image in ("127.0.0.1:5000/kubetrain/trainer:latest", "registry.local/kubetrain/sync:1", "kubetrain/trainer",
                  "tensorflow/tensorflow:2.21.0", "python:3.11-slim"):  # fmt: skip
        assert imap.resolve(image).runtime == "trainer", image
    for image in (
        "busybox",
        "busybox:1.36",
        "alpine:3.24.2",
        "docker.io/library/debian:bookworm",
        "ubuntu:24.04",
        "bash:5",
    ):
        assert imap.resolve(image).runtime == "host", image
    assert imap.resolve("nginx:1.27") is None


def meta_path():
    from include.devstack.kubeapi.images import DEFAULT_IMAGE_MAP

    return DEFAULT_IMAGE_MAP


async def _log_roundtrip(tmp_path):
    log = LogFile(tmp_path / "0.log")
    log.write("stdout", b"one\ntw")
    log.write("stderr", b"err\n")
    log.write("stdout", b"o\nthree")
    log.close()
    return read_entries(log.path)[0]


def test_log_file_keeps_lines_and_streams(tmp_path):
    import asyncio

    entries = asyncio.run(_log_roundtrip(tmp_path))
    assert [(e.stream, e.content) for e in entries] == [
        ("stdout", b"one"), ("stderr", b"err"), ("stdout", b"two"), ("stdout", b"three"),
    ]  # fmt: skip
    from include.devstack.kubeapi.logs import render

    assert re.fullmatch(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z one\n", render(entries[0], True))
    assert LogOptions().follow is False


def test_project_image_map_models_entrypoint_cmd_and_user():
    imap = ImageMap(meta_path())
    busybox = imap.resolve("busybox")
    assert (busybox.command, busybox.args, busybox.user) == ((), ("sh",), "0")  # sh is CMD: args replace it
    sync = imap.resolve("127.0.0.1:5000/kubetrain/sync:latest")
    assert (sync.command, sync.args, sync.user) == (("python", "-m", "trainer.sync"), ("--help",), "10001:10001")
    assert imap.resolve("127.0.0.1:5000/kubetrain/trainer:latest").user == "10001:10001"
    assert imap.resolve("python:3.11-slim").args == ("python3",)


def _protobuf_body(api_version: str, kind: str, message) -> bytes:
    from include.devstack.kubeapi import protobuf

    unknown = protobuf._message("k8s.io.apimachinery.pkg.runtime.Unknown")()
    unknown.typeMeta.apiVersion, unknown.typeMeta.kind = api_version, kind
    unknown.raw = message.SerializeToString()
    return protobuf.MAGIC + unknown.SerializeToString()


def test_protobuf_bodies_decode_to_the_json_form():
    from include.devstack.kubeapi import protobuf

    pod = protobuf._message("k8s.io.api.core.v1.Pod")()
    pod.metadata.name, pod.metadata.generateName = "p", ""  # an empty string is what Go writes for unset
    c = pod.spec.containers.add()
    c.name, c.image = "main", "busybox"
    c.resources.limits["memory"].string = "1Gi"
    probe = c.readinessProbe.handler.httpGet
    probe.port.type, probe.port.strVal = 1, "http"
    pod.spec.activeDeadlineSeconds = 30
    pod.spec.volumes.add(name="scratch").volumeSource.emptyDir.SetInParent()
    ref = c.env.add(name="TOKEN").valueFrom.secretKeyRef
    ref.localObjectReference.name, ref.key = "creds", "token"
    pod.metadata.creationTimestamp.seconds = 0
    out = protobuf.decode(_protobuf_body("v1", "Pod", pod))
    assert out["apiVersion"] == "v1" and out["kind"] == "Pod" and out["metadata"] == {"name": "p"}
    container = out["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"memory": "1Gi"}}
    assert container["readinessProbe"]["httpGet"]["port"] == "http"  # ProbeHandler is inline in JSON
    assert out["spec"]["activeDeadlineSeconds"] == 30
    assert out["spec"]["volumes"] == [{"name": "scratch", "emptyDir": {}}]  # VolumeSource is inline
    assert container["env"] == [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}]

    secret = protobuf._message("k8s.io.api.core.v1.Secret")()
    secret.metadata.name = "s"
    secret.data["token"] = b"\x00s3cr3t"
    assert protobuf.decode(_protobuf_body("v1", "Secret", secret))["data"] == {"token": "AHMzY3IzdA=="}


def test_protobuf_bodies_of_unknown_kinds_or_garbage_are_clear_errors():
    from include.devstack.kubeapi import protobuf

    deployment = protobuf._message("k8s.io.api.core.v1.ConfigMap")()
    with pytest.raises(meta.ApiError) as err:
        protobuf.decode(_protobuf_body("apps/v1", "Deployment", deployment))
    assert err.value.code == 415 and 'kind "Deployment" in "apps/v1"' in err.value.message
    with pytest.raises(meta.ApiError) as err:
        protobuf.decode(b'{"kind": "Pod"}')
    assert err.value.code == 400 and "magic" in err.value.message


def _pod(name: str, labels: dict, *, ip: str | None = "127.1.2.3", ready: bool = True, hostname: str | None = "h",
         subdomain: str = "svc", phase: str = "Running", namespace: str = "ns") -> dict:
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    spec = {"subdomain": subdomain, **({"hostname": hostname} if hostname else {})}
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels}, "spec": spec, "status": status}


def _svc(name: str = "svc", selector: dict | None = None, namespace: str = "ns", **spec) -> dict:
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterIP": "None", "selector": selector if selector is not None else {"app": "a"}, **spec}}  # fmt: skip


@pytest.mark.parametrize(
    ("pod", "services", "listed"),
    [
        (_pod("p", {"app": "a"}), [_svc()], True),
        (_pod("p", {"app": "b"}), [_svc()], False),  # not selected
        (_pod("p", {"app": "a"}), [_svc("other")], False),  # no Service named like the subdomain
        (_pod("p", {"app": "a"}), [_svc(namespace="elsewhere")], False),
        (_pod("p", {"app": "a"}, hostname=None), [_svc()], False),  # no spec.hostname: no record
        (_pod("p", {"app": "a"}, ip=None), [_svc()], False),
        (_pod("p", {"app": "a"}, ready=False), [_svc()], False),
        (_pod("p", {"app": "a"}, ready=False), [_svc(publishNotReadyAddresses=True)], True),
        (_pod("p", {"app": "a"}, phase="Succeeded"), [_svc()], False),
        (_pod("p", {"app": "a"}), [_svc(selector={})], False),  # a Service without selector has no endpoints
    ],
)  # fmt: skip
def test_dns_records_follow_the_endpoints_rules(pod, services, listed):
    from include.devstack.kubeapi import podnet

    assert podnet.dns_records([pod], services) == ([("127.1.2.3", "h", "svc", "ns")] if listed else [])


def test_hosts_file_has_the_kubelet_entries_aliases_and_records():
    from include.devstack.kubeapi import podnet

    pod = _pod("w-0", {}, hostname="w-0", subdomain="ring")
    pod["spec"]["hostAliases"] = [{"ip": "127.0.0.1", "hostnames": ["s3.local", "registry.local"]}]
    text = podnet.hosts_file(pod, "127.9.9.2", [("127.9.9.2", "w-0", "ring", "ns"), ("127.9.9.3", "w-1", "ring", "ns"),
                                                 ("127.9.9.4", "x", "other", "team")])  # fmt: skip
    lines = text.splitlines()
    assert lines[0] == "# Kubernetes-managed hosts file." and "127.0.0.1\tlocalhost" in lines
    assert "127.9.9.2\tw-0.ring.ns.svc.cluster.local\tw-0" in lines
    assert "127.0.0.1\ts3.local\tregistry.local" in lines
    assert "127.9.9.3\tw-1.ring.ns.svc.cluster.local w-1.ring.ns.svc w-1.ring.ns w-1.ring" in lines
    assert "127.9.9.4\tx.other.team.svc.cluster.local x.other.team.svc x.other.team" in lines  # no short form


def test_pod_addresses_are_per_server_and_reused_round_robin():
    from include.devstack.kubeapi import podnet

    a, b = podnet.Addresses(6443), podnet.Addresses(6444)
    assert a.allocate("u1") == "127.25.43.2" and b.allocate("u1") == "127.25.44.2"
    assert a.allocate("u1") == "127.25.43.2" and a.allocate("u2") == "127.25.43.3"
    a.release("u1")
    assert a.allocate("u3") == "127.25.43.4"  # not the one just released
    for i in range(250):
        a.allocate(f"fill-{i}")
    assert a.allocate("u4") == "127.25.43.2"  # wraps to the free one
    with pytest.raises(RuntimeError, match="253 pods"):
        a.allocate("one-too-many")


@pytest.mark.parametrize(
    ("image", "registry", "repository", "ref"),
    [
        ("127.0.0.1:5000/kubetrain/sync:latest", "127.0.0.1:5000", "kubetrain/sync", "latest"),
        ("localhost:5000/kubetrain/sync", "localhost:5000", "kubetrain/sync", "latest"),
        ("127.0.0.1:5000/kubetrain/trainer@sha256:" + "a" * 64, "127.0.0.1:5000", "kubetrain/trainer", "sha256:" + "a" * 64),
        ("busybox:1.36", "docker.io", "busybox", "1.36"),
        ("library/python:3.11-slim", "docker.io", "library/python", "3.11-slim"),
        ("registry.example.com/team/app:v1", "registry.example.com", "team/app", "v1"),
    ],
)  # fmt: skip
def test_image_references(image, registry, repository, ref):
    from include.devstack.kubeapi import pull

    parsed = pull.parse(image)
    assert (parsed.registry, parsed.repository, parsed.ref) == (registry, repository, ref)
    assert pull.same_registry(parsed.registry, "127.0.0.1:5000") == registry.endswith(":5000")


@pytest.mark.parametrize(
    ("pod_sc", "container_sc", "user", "problem"),
    [
        ({}, {}, "0", None),  # no runAsNonRoot: nothing to check
        ({"runAsNonRoot": True}, {}, "", "image will run as root"),
        ({"runAsNonRoot": True}, {}, "0:0", "image will run as root"),
        ({"runAsNonRoot": True}, {}, "10001:10001", None),
        ({"runAsNonRoot": True}, {}, "app", "non-numeric user (app)"),
        ({"runAsNonRoot": True, "runAsUser": 1000}, {}, "0", None),
        ({"runAsNonRoot": True}, {"runAsUser": 0}, "10001", "runAsUser breaks non-root policy"),
        ({}, {"runAsNonRoot": True}, "0", "image will run as root"),
        ({"runAsNonRoot": True}, {"runAsNonRoot": False}, "0", None),  # the container's setting wins
    ],
)  # fmt: skip
def test_run_as_non_root_verification(pod_sc, container_sc, user, problem):
    from include.devstack.kubeapi import pull

    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": {"securityContext": pod_sc}}
    got = pull.non_root_problem(pod, {"name": "main", "securityContext": container_sc}, user)
    if problem is None:
        assert got is None
    else:
        assert problem in got and got.endswith('(pod: "p_ns(u)", container: main)')


def test_stack_passes_its_strictness_to_the_local_api(tmp_path):
    from include.devstack.stack import Stack

    plain = Stack(tmp_path, strict=False, registry_check=False).kubeapi_argv(6443, 5000)
    assert "--strict" not in plain and "--registry" not in plain
    argv = Stack(tmp_path).kubeapi_argv(6443, 5000)  # strict and checking the registry by default
    assert "--strict" in argv and argv[argv.index("--registry") + 1] == "127.0.0.1:5000"


def test_openapi_v3_documents_hold_every_schema_they_reference():
    import json

    from include.devstack.kubeapi import openapi

    index = openapi._v3_index()["paths"]
    assert set(index) == {"api/v1", "apis/batch/v1", "apis/events.k8s.io/v1", "apis/apiextensions.k8s.io/v1"}
    for group in ("", "batch", "events.k8s.io", "apiextensions.k8s.io"):
        body, digest = openapi._v3_document(group)
        assert index[f"apis/{group}/v1" if group else "api/v1"]["serverRelativeURL"].endswith(f"?hash={digest}")
        schemas = json.loads(body)["components"]["schemas"]
        refs = {part.split('"', 1)[0] for part in body.decode().split('"$ref":"#/components/schemas/')[1:]}
        assert refs and refs <= set(schemas), refs - set(schemas)
        kinds = {gvk["kind"] for s in schemas.values() for gvk in s.get("x-kubernetes-group-version-kind", [])
                 if gvk["group"] == group}  # fmt: skip
        assert {r.kind for r in meta.RESOURCES.values() if r.group == group} <= kinds
    pod = json.loads(openapi._v3_document("")[0])["components"]["schemas"]["io.k8s.api.core.v1.Pod"]
    assert pod["properties"]["spec"] == {"allOf": [{"$ref": "#/components/schemas/io.k8s.api.core.v1.PodSpec"}],
                                         "description": pod["properties"]["spec"]["description"]}  # fmt: skip
    assert pod["properties"]["kind"]["type"] == "string" and "enum" not in pod["properties"]["kind"]
