"""The OCI distribution client against Debian's docker-registry: auth, manifests, platforms, errors."""

from __future__ import annotations

import json

import pytest

from include.devstack.stack import free_port
from kubetrain.imagebuild.oci import OCI_INDEX, RegistryClient, canonical_json, select_platform
from kubetrain.imagebuild.oci_auth import parse_challenge
from kubetrain.imagebuild.reference import parse_reference
from kubetrain.imagebuild.registry_errors import RegistryAuthError, RegistryError, RegistryUnreachable
from tests.plugins.imagebuild.support import (
    push_busybox_base,
    skopeo_pull,
    start_registry,
    start_token_registry,
)


@pytest.fixture(scope="module")
def open_registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("open-registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("auth-registry"), users={"builder": "s3cret-pass"})
    yield reg
    reg.stop()


def test_push_then_read_back_with_skopeo(open_registry, tmp_path):
    with open_registry.client() as client:
        digest = push_busybox_base(client, "base/busybox", "1", tmp_path)
        assert client.manifest_digest("base/busybox", "1") == digest
        manifest = client.get_manifest("base/busybox", digest)
    pulled = skopeo_pull(f"{open_registry.host}/base/busybox:1", tmp_path / "oci")
    assert pulled.manifest == json.loads(manifest.raw)
    fs = pulled.filesystem()
    assert fs["bin/busybox"] == open("/bin/busybox", "rb").read()
    assert fs["bin/sh"] == "link:busybox"
    assert pulled.env["PATH"] == "/bin"


def test_basic_auth_accepts_good_credentials(auth_registry, tmp_path):
    with auth_registry.client("builder", "s3cret-pass") as client:
        client.ping()
        digest = push_busybox_base(client, "team/base", "v1", tmp_path)
    pulled = skopeo_pull(f"{auth_registry.host}/team/base:v1", tmp_path / "oci", creds="builder:s3cret-pass")
    assert pulled.manifest["config"]["digest"]
    assert digest.startswith("sha256:")


@pytest.mark.parametrize(
    ("user", "password", "expected"),
    [
        ("builder", "wrong", "refused the credentials of user 'builder'"),
        ("nobody", "s3cret-pass", "refused the credentials of user 'nobody'"),
        (None, None, "requires credentials"),
    ],
)
def test_basic_auth_refusals_are_clear(auth_registry, user, password, expected):
    with auth_registry.client(user, password) as client:
        with pytest.raises(RegistryAuthError, match=expected) as err:
            client.manifest_digest("team/base", "v1")
    assert auth_registry.host in str(err.value)
    assert "s3cret" not in str(err.value) and "wrong" not in str(err.value)


def test_unreachable_registry_names_the_url():
    port = free_port()
    with RegistryClient(f"127.0.0.1:{port}", insecure=True, timeout=5) as client:
        with pytest.raises(RegistryUnreachable, match=rf"registry http://127.0.0.1:{port} is unreachable"):
            client.ping()


def test_tls_to_plain_http_registry_suggests_insecure(open_registry):
    with RegistryClient(open_registry.host, timeout=5) as client:
        with pytest.raises(RegistryUnreachable, match="set\\s+insecure"):
            client.ping()


def test_unknown_manifest(open_registry):
    with open_registry.client() as client:
        with pytest.raises(RegistryError, match=r"base/busybox:nope: not found .*MANIFEST_UNKNOWN"):
            client.get_manifest("base/busybox", "nope")
        assert client.manifest_digest("base/busybox", "nope") is None


def _push_index(client: RegistryClient, tmp_path) -> str:
    amd = push_busybox_base(client, "multi/base", "amd64-only", tmp_path / "a")
    amd_manifest = client.get_manifest("multi/base", amd)
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": amd_manifest.media_type,
                "digest": amd,
                "size": len(amd_manifest.raw),
                "platform": {"os": "linux", "architecture": "amd64"},
            },
            {
                "mediaType": amd_manifest.media_type,
                "digest": amd,
                "size": len(amd_manifest.raw),
                "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"},
            },
        ],
    }
    raw = canonical_json(index)
    client.put_manifest("multi/base", "index", raw, OCI_INDEX)
    return amd


def test_index_picks_platform_or_lists_available(open_registry, tmp_path):
    with open_registry.client() as client:
        amd = _push_index(client, tmp_path)
        index = client.get_manifest("multi/base", "index")
        assert index.is_index
        assert select_platform(client, "multi/base", index, "linux/amd64").digest == amd
        assert select_platform(client, "multi/base", index, "linux/arm64").digest == amd
        with pytest.raises(
            RegistryError, match=r"without 'linux/s390x'; platforms available: linux/amd64, linux/arm64/v8"
        ):
            select_platform(client, "multi/base", index, "linux/s390x")


@pytest.mark.parametrize(
    ("header", "scheme", "params"),
    [
        ('Basic realm="kubetrain"', "basic", {"realm": "kubetrain"}),
        (
            'Bearer realm="https://auth.example.com/token",service="registry.example.com",scope="repository:a/b:pull"',
            "bearer",
            {
                "realm": "https://auth.example.com/token",
                "service": "registry.example.com",
                "scope": "repository:a/b:pull",
            },
        ),
    ],
)
def test_parse_challenge(header, scheme, params):
    assert parse_challenge(header) == (scheme, params)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kubetrain/trainer:1", ("reg:5000", "kubetrain/trainer", "1", None)),
        ("127.0.0.1:5000/a/b:v2", ("127.0.0.1:5000", "a/b", "v2", None)),
        ("localhost/a@sha256:" + "0" * 64, ("localhost", "a", None, "sha256:" + "0" * 64)),
        (
            "registry.example.com/a:b@sha256:" + "1" * 64,
            ("registry.example.com", "a", "b", "sha256:" + "1" * 64),
        ),
        ("docker://a/b", ("reg:5000", "a/b", None, None)),
    ],
)
def test_parse_reference(text, expected):
    ref = parse_reference(text, "reg:5000")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Kubetrain/Trainer:1", "invalid repository name 'Kubetrain/Trainer'"),
        ("a/b:-bad", "invalid image tag '-bad'"),
        ("a/b@sha256:xyz", "invalid digest 'sha256:xyz'"),
        ("", "expected \\[registry/\\]repository"),
    ],
)
def test_parse_reference_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_reference(text, "reg:5000")


def test_bearer_token_auth(tmp_path, monkeypatch):
    """A registry with token auth (as Docker Hub and GHCR): the client follows the challenge to the realm, a token
    service the deployment trusts (on another host than the registry, as Docker Hub's)."""
    reg, tokens = start_token_registry(tmp_path / "token-registry", {"ci": "tok-pass"})
    monkeypatch.setenv("KUBETRAIN_TOKEN_SERVICES", tokens.realm)
    try:
        with reg.client("ci", "tok-pass") as client:
            digest = push_busybox_base(client, "team/base", "v1", tmp_path / "base")
            assert client.manifest_digest("team/base", "v1") == digest
        scopes = [a for claims in tokens.issued for a in claims["access"]]
        assert {"type": "repository", "name": "team/base", "actions": ["pull", "push"]} in scopes
        assert all(claims["sub"] == "ci" for claims in tokens.issued)
        # A ready token (as CI systems hand out) is sent as is, without a round trip to the realm.
        import requests

        token = requests.get(
            tokens.realm,
            params={"service": tokens.service, "scope": "repository:team/base:pull"},
            auth=("ci", "tok-pass"),
            timeout=10,
        ).json()["token"]
        issued = len(tokens.issued)
        with RegistryClient(reg.host, insecure=True, token=token) as client:
            assert client.manifest_digest("team/base", "v1") == digest
        assert len(tokens.issued) == issued
        with reg.client("ci", "wrong") as client:
            with pytest.raises(
                RegistryAuthError, match=r"token service http://127.0.0.1:\d+/token .* refused user 'ci'"
            ):
                client.manifest_digest("team/base", "v1")
        with reg.client() as client:  # anonymous: a pull-only token, so a push is denied
            with pytest.raises(RegistryAuthError, match="registry .* (refused|requires|denied)"):
                push_busybox_base(client, "team/base", "v2", tmp_path / "anon")
    finally:
        reg.stop()
        tokens.stop()


@pytest.mark.parametrize(
    ("registry", "realm", "allowed"),
    [
        ("registry-1.docker.io", "https://auth.docker.io/token", True),
        ("registry-1.docker.io", "https://production.cloudflare.docker.com/registry-v2/x", True),
        ("registry-1.docker.io", "http://auth.docker.io/token", False),  # known hosts over HTTPS only
        ("registry-1.docker.io", "https://auth.docker.io:8443/token", False),
        ("ghcr.io", "https://auth.docker.io/token", False),  # a row serves its own registry only
        (
            "123456789012.dkr.ecr.eu-west-1.amazonaws.com",
            "https://prod-eu-west-1-starport-layer-bucket.s3.eu-west-1.amazonaws.com/x",
            True,
        ),
        (  # '*' never spans a dot: another bucket name under another domain does not match
            "123456789012.dkr.ecr.eu-west-1.amazonaws.com",
            "https://prod-a.evil.example-starport-layer-bucket.s3.eu-west-1.amazonaws.com/x",
            False,
        ),
        ("gcr.io", "https://storage.googleapis.com/artifacts.p.appspot.com/x", True),
    ],
)
def test_known_services_are_trusted_per_registry(registry, realm, allowed):
    """KNOWN_SERVICES, the one table of token services and blob storage hosts, without any request."""
    from kubetrain.imagebuild.registry_errors import RealmRefused

    client = RegistryClient(registry, token_services=[])
    if allowed:
        assert client.check_realm(realm, params=[("scope", "s")]).url.startswith(realm)
    else:
        with pytest.raises(RealmRefused, match="which is neither the registry's own host nor a trusted"):
            client.check_realm(realm)


@pytest.mark.parametrize(
    ("entry", "realm", "allowed"),
    [
        ("https://auth.example.com/token", "https://auth.example.com/token", True),
        ("https://auth.example.com/token", "https://auth.example.com/token/v2", True),
        ("https://auth.example.com/token", "https://auth.example.com/tokens", False),  # a path, not a prefix
        ("https://auth.example.com/token", "https://auth.example.com:444/token", False),
        ("auth.example.com", "https://auth.example.com/any", True),
        ("auth.example.com", "http://auth.example.com/any", False),  # a bare host is trusted over HTTPS only
    ],
)
def test_token_services_entries(entry, realm, allowed):
    from kubetrain.imagebuild.registry_errors import RealmRefused

    client = RegistryClient("registry.example.com", token_services=[entry])
    if allowed:
        client.check_realm(realm)
    else:
        with pytest.raises(RealmRefused, match="refused, nothing was sent there"):
            client.check_realm(realm)
