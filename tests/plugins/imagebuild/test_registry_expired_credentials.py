"""Credentials that expired: the dev stack's registry (docker-registry) refuses them, and the error says they
expired and how to renew them for that kind of registry, naming the connection, never the secret."""

from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime

import pytest
import requests

from kubetrain.hooks.registry import RegistryHook
from kubetrain.imagebuild.oci import RegistryClient
from kubetrain.imagebuild.oci_auth import CredentialOrigin, credential_expiry
from kubetrain.imagebuild.registry_errors import RegistryAuthError
from tests.plugins.imagebuild import support
from tests.plugins.imagebuild.support import bcrypt_hash, start_registry, start_token_registry


def set_conn(monkeypatch, conn_id: str, **conn) -> str:
    conn.setdefault("conn_type", "kubetrain_registry")
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conn_id


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def ecr_style_password(expiration: float) -> str:
    """The shape of an ECR password: base64 of a JSON document that carries its ``expiration``."""
    doc = {
        "payload": "opaque",
        "datakey": "opaque",
        "version": "2",
        "type": "DATA_KEY",
        "expiration": expiration,
    }
    return base64.b64encode(json.dumps(doc).encode()).decode()


def test_a_registry_token_past_its_expiry_is_refused_and_named_expired(tmp_path, monkeypatch):
    reg, tokens = start_token_registry(tmp_path / "token-registry", {"ci": "tok-pass"})
    monkeypatch.setenv("KUBETRAIN_TOKEN_SERVICES", tokens.realm)
    try:
        # a token the service issued an hour ago (valid for 5 minutes): the registry refuses it
        an_hour_ago = time.time() - 3600
        with pytest.MonkeyPatch.context() as clock:
            clock.setattr(support.time, "time", lambda: an_hour_ago)
            token = requests.get(
                tokens.realm,
                params={"service": tokens.service, "scope": "repository:team/base:pull"},
                auth=("ci", "tok-pass"),
                timeout=10,
            ).json()["token"]
        conn_id = set_conn(
            monkeypatch,
            "reg_token",
            host="127.0.0.1",
            port=reg.port,
            extra={"insecure": True, "token": token},
        )
        mark = reg.mark()
        with RegistryHook(registry_conn_id=conn_id).get_conn() as client:
            with pytest.raises(RegistryAuthError) as refused:
                client.manifest_digest("team/base", "v1")
        assert [r.status for r in reg.requests(mark)] == [401]  # the registry itself refused it
        message = str(refused.value)
        assert "refused the credentials of the configured token for HEAD team/base:v1" in message
        assert "they have expired (they carry an expiry" in message and "that is past" in message
        assert "update the password (or token) of connection 'reg_token'" in message
        assert token not in message and token.split(".")[1] not in message
        # the image operators' digest lookup (pin_image) fails with that sentence, retried
        from kubetrain.images import ImageResolutionError, pin_image

        with pytest.raises(ImageResolutionError) as lookup:
            pin_image(f"127.0.0.1:{reg.port}/team/base:v1", registry_conn_id=conn_id)
        assert "they have expired" in str(lookup.value) and "connection 'reg_token'" in str(lookup.value)
        assert token not in str(lookup.value)
    finally:
        reg.stop()
        tokens.stop()


def test_credentials_accepted_earlier_and_refused_now_are_named_expired(tmp_path, monkeypatch):
    reg = start_registry(tmp_path / "reg", users={"ci": "first-pass"})
    try:
        conn_id = set_conn(
            monkeypatch,
            "reg_rotated",
            host="127.0.0.1",
            port=reg.port,
            login="ci",
            password="first-pass",
            extra={"insecure": True},
        )
        with RegistryHook(registry_conn_id=conn_id).get_conn() as client:
            client.ping()  # accepted
            # the password is rotated (a token that ran out): the registry now refuses the one the task holds
            (reg.root / "htpasswd").write_text(f"ci:{bcrypt_hash('second-pass')}\n")
            wait_for(
                lambda: (
                    requests.get(f"http://{reg.host}/v2/", auth=("ci", "first-pass"), timeout=10).status_code
                    == 401
                ),
                30,
                what="the registry to refuse the old password",
            )
            with pytest.raises(RegistryAuthError) as refused:
                client.manifest_digest("kubetrain/trainer", "latest")
        message = str(refused.value)
        assert "registry 127.0.0.1:" in message and "refused the credentials of user 'ci'" in message
        assert (
            "they have expired (the registry accepted them earlier in this task and refuses them now)"
            in message
        )
        assert "update the password (or token) of connection 'reg_rotated'" in message
        assert "first-pass" not in message
    finally:
        reg.stop()


def test_wrong_credentials_are_not_called_expired(tmp_path, monkeypatch):
    reg = start_registry(tmp_path / "reg", users={"ci": "good"})
    try:
        conn_id = set_conn(
            monkeypatch,
            "reg_wrong",
            host="127.0.0.1",
            port=reg.port,
            login="ci",
            password="bad",
            extra={"insecure": True},
        )
        with RegistryHook(registry_conn_id=conn_id).get_conn() as client:
            with pytest.raises(RegistryAuthError) as refused:
                client.ping()
        message = str(refused.value)
        assert "refused the credentials of user 'ci'" in message and "expired" not in message
        assert "connection 'reg_wrong'" in message and "bad" not in message.replace("bad request", "")
    finally:
        reg.stop()


@pytest.mark.parametrize(
    ("origin", "advice"),
    [
        (
            CredentialOrigin("registry_ecr", "ecr"),
            "a pasted ECR password lasts 12 hours: remove the password from connection 'registry_ecr'",
        ),
        (
            CredentialOrigin("registry_ecr", "ecr", renewed=True, aws_conn_id="aws_ci"),
            "connection 'registry_ecr' gets a fresh ECR password through the amazon provider (AWS connection "
            "'aws_ci') each time it is used",
        ),
        (
            CredentialOrigin("registry_gar", "artifact-registry"),
            "install kubetrain[gcp] (pip install 'kubetrain[gcp]') and remove the password from connection "
            "'registry_gar'",
        ),
        (
            CredentialOrigin("registry_gar", "artifact-registry", renewed=True),
            "connection 'registry_gar' gets a fresh access token from Google's Application Default Credentials",
        ),
        (
            CredentialOrigin("registry_hub", "other"),
            "update the password (or token) of connection 'registry_hub'",
        ),
    ],
    ids=["ecr-pasted", "ecr-renewed", "gar-pasted", "gar-renewed", "other"],
)
def test_an_expired_ecr_style_password_is_refused_with_the_renewal_of_each_registry_kind(
    tmp_path, origin, advice
):
    """The registry refuses an ECR-shaped password whose expiration is past; the advice is the registry kind's."""
    reg = start_registry(tmp_path / "reg", users={"AWS": "current"})
    expired = ecr_style_password(time.time() - 60)
    try:
        with RegistryClient(reg.host, insecure=True, username="AWS", password=expired, timeout=30) as client:
            client.credential_origin = origin
            with pytest.raises(RegistryAuthError) as refused:
                client.manifest_digest("kubetrain/trainer", "latest")
        message = str(refused.value)
        assert "refused the credentials of user 'AWS'" in message and "they have expired" in message
        assert advice in message
        assert expired not in message
    finally:
        reg.stop()


@pytest.mark.parametrize(
    ("secret", "expected"),
    [
        (ecr_style_password(1_700_000_000), datetime.fromtimestamp(1_700_000_000, UTC)),
        (
            "e30."
            + base64.urlsafe_b64encode(json.dumps({"exp": 1_800_000_000}).encode()).decode().rstrip("=")
            + ".sig",
            datetime.fromtimestamp(1_800_000_000, UTC),
        ),
        ("ya29.an-opaque-google-access-token", None),
        ("plain-password", None),
        (base64.b64encode(b'{"expiration": true}').decode(), None),
        (None, None),
    ],
    ids=["ecr", "jwt", "google-opaque", "password", "not-a-number", "none"],
)
def test_credential_expiry(secret, expected):
    assert credential_expiry(secret) == expected


def test_credential_origin_refuses_an_unknown_kind():
    with pytest.raises(
        ValueError, match="kind 'quay' is not valid: expected ecr, artifact-registry or other"
    ):
        CredentialOrigin("c", "quay")
