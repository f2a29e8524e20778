"""Pure functions of the local Kubernetes API: selectors, patches, $(VAR) expansion, image references, runtime specs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from include.devstack.kubeapi import images, meta, oci, patch, runtime, selectors
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
        ("stdout", b"one"),
        ("stderr", b"err"),
        ("stdout", b"two"),
        ("stdout", b"three"),
    ]
    from include.devstack.kubeapi.logs import render

    assert re.fullmatch(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z one\n", render(entries[0], True))
    assert LogOptions().follow is False


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
    assert container["env"] == [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}
    ]

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


def _pod(
    name: str,
    labels: dict,
    *,
    ip: str | None = "127.1.2.3",
    ready: bool = True,
    hostname: str | None = "h",
    subdomain: str = "svc",
    phase: str = "Running",
    namespace: str = "ns",
) -> dict:
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    spec = {"subdomain": subdomain, **({"hostname": hostname} if hostname else {})}
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": spec,
        "status": status,
    }


def _svc(name: str = "svc", selector: dict | None = None, namespace: str = "ns", **spec) -> dict:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": "None", "selector": selector if selector is not None else {"app": "a"}, **spec},
    }


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
)
def test_dns_records_follow_the_endpoints_rules(pod, services, listed):
    from include.devstack.kubeapi import podnet

    assert podnet.dns_records([pod], services) == ([("127.1.2.3", "h", "svc", "ns")] if listed else [])


def test_hosts_file_has_the_kubelet_entries_aliases_and_records():
    from include.devstack.kubeapi import podnet

    pod = _pod("w-0", {}, hostname="w-0", subdomain="ring")
    pod["spec"]["hostAliases"] = [{"ip": "127.0.0.1", "hostnames": ["s3.local", "registry.local"]}]
    text = podnet.hosts_file(
        pod,
        "127.9.9.2",
        [
            ("127.9.9.2", "w-0", "ring", "ns"),
            ("127.9.9.3", "w-1", "ring", "ns"),
            ("127.9.9.4", "x", "other", "team"),
        ],
    )
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
        (
            "127.0.0.1:5000/kubetrain/trainer@sha256:" + "a" * 64,
            "127.0.0.1:5000",
            "kubetrain/trainer",
            "sha256:" + "a" * 64,
        ),
        ("busybox:1.36", "docker.io", "library/busybox", "1.36"),
        ("library/python:3.11-slim", "docker.io", "library/python", "3.11-slim"),
        ("tensorflow/tensorflow:2.21.0", "docker.io", "tensorflow/tensorflow", "2.21.0"),
        ("registry.example.com/team/app:v1", "registry.example.com", "team/app", "v1"),
        (
            "europe-west4-docker.pkg.dev/proj/repo/kubetrain/sync:v1",
            "europe-west4-docker.pkg.dev",
            "proj/repo/kubetrain/sync",
            "v1",
        ),
    ],
)
def test_image_references(image, registry, repository, ref):
    parsed = images.parse(image)
    assert (parsed.registry, parsed.repository, parsed.ref) == (registry, repository, ref)
    assert images.is_loopback(parsed.registry) == registry.startswith(("127.", "localhost"))


def test_registries_conf_mirrors_the_public_registries_and_allows_http_only_on_loopback():
    text = images.registries_conf("127.0.0.1:5001", ["127.0.0.1:5000"])
    blocks = text.split("\n\n")
    assert 'short-name-mode = "disabled"' in blocks[0]
    docker = next(b for b in blocks if 'prefix = "docker.io"' in b)
    assert '[[registry.mirror]]\nlocation = "127.0.0.1:5001"\ninsecure = true' in docker
    assert any('location = "quay.io"' in b and "127.0.0.1:5001" in b for b in blocks)
    assert blocks[-1] == '[[registry]]\nlocation = "127.0.0.1:5000"\ninsecure = true\n'
    assert "insecure" not in images.registries_conf(None, [])


def test_pull_secret_credentials_come_from_dockerconfigjson_secrets():
    import base64
    import json

    def secret(doc: dict, key: str = ".dockerconfigjson") -> dict:
        return {"data": {key: base64.b64encode(json.dumps(doc).encode()).decode()}}

    auths = images.pull_secret_auths(
        [
            secret({"auths": {"r.example": {"auth": "dTpw"}}}),
            secret({"r.example": {"auth": "b3RoZXI6eA=="}, "old.example": {"auth": "eDp5"}}, ".dockercfg"),
            {"data": {"other": "eA=="}},
        ]
    )
    assert auths == {"r.example": {"auth": "dTpw"}, "old.example": {"auth": "eDp5"}}  # the first Secret wins


@pytest.fixture
def image_etc(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\napp:x:1234:2345:app:/home/app:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\napp:x:2345:\nvideo:x:44:app,other\n")
    return tmp_path


@pytest.mark.parametrize(
    ("image_user", "pod_sc", "sc", "expected"),
    [
        ("", {}, {}, (0, 0, (), "/root")),
        ("10001:10001", {}, {}, (10001, 10001, (), "/")),
        ("app", {}, {}, (1234, 2345, (44,), "/home/app")),
        ("app:video", {}, {}, (1234, 44, (), "/home/app")),
        ("1234", {}, {}, (1234, 2345, (44,), "/home/app")),
        ("app", {"runAsUser": 500}, {}, (500, 0, (), "/")),
        (
            "app",
            {"runAsUser": 500, "runAsGroup": 600, "supplementalGroups": [7], "fsGroup": 8},
            {"runAsUser": 1234},
            (1234, 600, (44, 7, 8), "/home/app"),
        ),
    ],
)
def test_the_process_user_is_resolved_in_the_image(image_etc, image_user, pod_sc, sc, expected):
    user = oci.resolve_user(image_etc, image_user, pod_sc, sc)
    assert (user.uid, user.gid, user.additional_gids, user.home) == expected


def test_an_unknown_user_name_is_a_create_error(image_etc):
    with pytest.raises(oci.UserError, match="unable to find user nobody: no matching entries in passwd file"):
        oci.resolve_user(image_etc, "nobody", {}, {})
    with pytest.raises(oci.UserError, match="unable to find group staff"):
        oci.resolve_user(image_etc, "app:staff", {}, {})


def test_runtime_spec_applies_the_security_context_and_resources(tmp_path):
    user = oci.User(10001, 10001, (), "/", None)
    container = {
        "name": "main",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        },
        "resources": {"limits": {"memory": "64Mi", "cpu": "500m"}, "requests": {"cpu": "250m"}},
    }
    spec = oci.runtime_spec(
        rootfs=tmp_path,
        argv=["sh"],
        env={"A": "1"},
        cwd="/w",
        user=user,
        hostname="h",
        mounts=[{"src": "/v", "dst": "/data", "ro": True}],
        container=container,
        cgroups_path="/kubetrain/x/1",
    )
    assert spec["process"]["capabilities"]["bounding"] == ["CAP_NET_BIND_SERVICE"]
    assert spec["process"]["noNewPrivileges"] is True and spec["root"]["readonly"] is True
    assert spec["process"]["user"] == {"uid": 10001, "gid": 10001} and spec["process"]["env"] == ["A=1"]
    assert spec["linux"]["resources"]["memory"] == {"limit": 64 * 2**20}
    assert spec["linux"]["resources"]["cpu"] == {"quota": 50_000, "period": 100_000, "shares": 256}
    assert {"type": "network"} not in spec["linux"]["namespaces"]  # the pod binds its own loopback address
    assert spec["mounts"][-1] == {
        "destination": "/data",
        "type": "bind",
        "source": "/v",
        "options": ["rbind", "rprivate", "ro"],
    }
    privileged = oci.runtime_spec(
        rootfs=tmp_path,
        argv=["sh"],
        env={},
        cwd="/",
        user=user,
        hostname="h",
        mounts=[],
        container={"name": "b", "securityContext": {"privileged": True}},
        cgroups_path="/k",
    )
    assert (
        "CAP_SYS_ADMIN" in privileged["process"]["capabilities"]["bounding"]
        and not privileged["linux"]["maskedPaths"]
    )


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
)
def test_run_as_non_root_verification(pod_sc, container_sc, user, problem):
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": {"securityContext": pod_sc}}
    got = oci.non_root_problem(pod, {"name": "main", "securityContext": container_sc}, user)
    if problem is None:
        assert got is None
    else:
        assert problem in got and got.endswith('(pod: "p_ns(u)", container: main)')


def test_stack_points_the_local_api_at_its_mirror(tmp_path):
    from include.devstack.stack import Stack

    argv = Stack(tmp_path).kubeapi_argv(6443, 5001)
    assert argv[argv.index("--mirror") + 1] == "127.0.0.1:5001" and "--strict-gpu" not in argv
    assert "--strict-gpu" in Stack(tmp_path, strict_gpu=True).kubeapi_argv(6443, 5001)
    kueue = Path(argv[argv.index("--kueue-config") + 1])
    assert "deploy/kueue/queues.yaml" in kueue.read_text()  # the queues a cluster gets


def test_openapi_v3_documents_hold_every_schema_they_reference():
    import json

    from include.devstack.kubeapi import openapi

    index = openapi._v3_index()["paths"]
    assert set(index) == {
        "api/v1",
        "apis/batch/v1",
        "apis/events.k8s.io/v1",
        "apis/apiextensions.k8s.io/v1",
        "apis/rbac.authorization.k8s.io/v1",
        "apis/authorization.k8s.io/v1",
    }
    for group in ("", "batch", "events.k8s.io", "apiextensions.k8s.io"):
        body, digest = openapi._v3_document(group)
        assert index[f"apis/{group}/v1" if group else "api/v1"]["serverRelativeURL"].endswith(
            f"?hash={digest}"
        )
        schemas = json.loads(body)["components"]["schemas"]
        refs = {part.split('"', 1)[0] for part in body.decode().split('"$ref":"#/components/schemas/')[1:]}
        assert refs and refs <= set(schemas), refs - set(schemas)
        kinds = {
            gvk["kind"]
            for s in schemas.values()
            for gvk in s.get("x-kubernetes-group-version-kind", [])
            if gvk["group"] == group
        }
        assert {r.kind for r in meta.RESOURCES.values() if r.group == group} <= kinds
    pod = json.loads(openapi._v3_document("")[0])["components"]["schemas"]["io.k8s.api.core.v1.Pod"]
    assert pod["properties"]["spec"] == {
        "allOf": [{"$ref": "#/components/schemas/io.k8s.api.core.v1.PodSpec"}],
        "description": pod["properties"]["spec"]["description"],
    }
    assert pod["properties"]["kind"]["type"] == "string" and "enum" not in pod["properties"]["kind"]
