"""RegistryHook: connection parsing, precedence of arguments over extras, contradictions, auth files."""

from __future__ import annotations

import base64
import json
import stat

import pytest

from kubetrain.hooks.registry import RegistryHook
from tests.plugins.imagebuild.support import start_registry


def set_conn(monkeypatch, conn_id: str, **conn) -> str:
    conn.setdefault("conn_type", "kubetrain_registry")
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conn_id


@pytest.mark.parametrize(
    ("conn", "hook_args", "expected"),
    [
        ({"host": "registry.example.com"}, {}, ("registry.example.com", False, True, None)),
        (
            {"host": "127.0.0.1", "port": 5000, "extra": {"insecure": True}},
            {},
            ("127.0.0.1:5000", True, True, None),
        ),
        ({"host": "http://reg.local:5000"}, {}, ("reg.local:5000", True, True, None)),
        ({"host": "https://reg.example.com/"}, {}, ("reg.example.com", False, True, None)),
        (
            {"host": "reg.example.com", "extra": {"insecure": "true"}},
            {"insecure": False},
            ("reg.example.com", False, True, None),
        ),
        (
            {"host": "reg.example.com", "extra": {"tls_verify": "false"}},
            {},
            ("reg.example.com", False, False, None),
        ),
        (
            {"host": "reg.example.com", "extra": {"tls_verify": False}},
            {"tls_verify": True},
            ("reg.example.com", False, True, None),
        ),
        (
            {"conn_type": "docker", "host": "ghcr.io", "login": "bot", "password": "pat"},
            {},
            ("ghcr.io", False, True, None),
        ),
    ],
)
def test_settings(monkeypatch, conn, hook_args, expected):
    hook = RegistryHook(set_conn(monkeypatch, "reg_case", **conn), **hook_args)
    s = hook.settings
    assert (s.registry, s.insecure, s.tls_verify, s.ca_bundle) == expected


def test_explicit_token_beats_extra_and_never_shows_in_repr(monkeypatch):
    hook = RegistryHook(
        set_conn(monkeypatch, "reg_tok", host="r.example.com", extra={"token": "from-extra"}),
        token="from-arg",
    )
    assert hook.settings.token == "from-arg"
    assert "from-arg" not in repr(hook.settings)
    assert hook.docker_config() == {"auths": {"r.example.com": {"registrytoken": "from-arg"}}}


@pytest.mark.parametrize(
    ("conn", "hook_args", "message"),
    [
        (
            {"host": "r.example.com", "extra": {"insecure": True, "ca_bundle": "/etc/ssl/ca.pem"}},
            {},
            r"insecure=True \(plain HTTP\) cannot be combined with ca_bundle='/etc/ssl/ca.pem'",
        ),
        (
            {"host": "r.example.com", "extra": {"ca_bundle": "/etc/ssl/ca.pem"}},
            {"tls_verify": False},
            "tls_verify=False cannot be combined with ca_bundle='/etc/ssl/ca.pem'",
        ),
        (
            {"host": "r.example.com", "password": "p", "login": "u", "extra": {"token": "t"}},
            {},
            "token cannot be combined with a password",
        ),
        (
            {"host": "https://r.example.com"},
            {"insecure": True},
            "host 'https://r.example.com' says HTTPS but the insecure argument says insecure=True",
        ),
        (
            {"host": "http://r.example.com", "extra": {"insecure": False}},
            {},
            "host 'http://r.example.com' says HTTP but the insecure extra says insecure=False",
        ),
        (
            {"host": "r.example.com", "extra": {"insecure": "maybe"}},
            {},
            "invalid insecure 'maybe': expected true or false",
        ),
        ({"host": ""}, {}, "connection 'reg_bad' has no host"),
        (
            {"host": "r.example.com", "extra": {"ca_bundle": "/nonexistent/ca.pem"}},
            {},
            "ca_bundle '/nonexistent/ca.pem' does not exist",
        ),
        ({"host": "r.example.com", "extra": {"timeout": -1}}, {}, "invalid timeout -1.0"),
    ],
)
def test_contradictions_fail_loudly(monkeypatch, conn, hook_args, message):
    hook = RegistryHook(set_conn(monkeypatch, "reg_bad", **conn), **hook_args)
    with pytest.raises(ValueError, match=message):
        hook.settings  # noqa: B018


def test_ca_bundle_is_used_for_verification(monkeypatch, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    hook = RegistryHook(set_conn(monkeypatch, "reg_ca", host="r.example.com", extra={"ca_bundle": str(ca)}))
    assert hook.settings.verify == str(ca)
    assert hook.get_conn().base_url == "https://r.example.com"


def test_authfile_is_private_and_holds_basic_auth(monkeypatch, tmp_path):
    hook = RegistryHook(
        set_conn(monkeypatch, "reg_auth", host="127.0.0.1", port=5000, login="ci", password="pw")
    )
    path = hook.write_authfile(tmp_path / "auth" / "auth.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    auth = json.loads(path.read_text())["auths"]["127.0.0.1:5000"]["auth"]
    assert base64.b64decode(auth).decode() == "ci:pw"


def test_authfile_refuses_a_token(monkeypatch, tmp_path):
    hook = RegistryHook(set_conn(monkeypatch, "reg_t", host="r.example.com", extra={"token": "t"}))
    with pytest.raises(ValueError, match="buildah needs a login and password"):
        hook.write_authfile(tmp_path / "auth.json")


def test_test_connection_against_htpasswd_registry(monkeypatch, tmp_path):
    reg = start_registry(tmp_path / "reg", users={"ci": "good"})
    try:
        base = {"host": "127.0.0.1", "port": reg.port, "login": "ci", "extra": {"insecure": True}}
        ok, message = RegistryHook(
            set_conn(monkeypatch, "reg_live", password="good", **base)
        ).test_connection()
        assert ok, message
        ok, message = RegistryHook(
            set_conn(monkeypatch, "reg_live", password="bad", **base)
        ).test_connection()
        assert not ok and "refused the credentials of user 'ci'" in message and "bad" not in message
    finally:
        reg.stop()


ECR = "123456789012.dkr.ecr.eu-west-2.amazonaws.com"


def _aws_conn(monkeypatch, moto_server, conn_id: str = "aws_default") -> None:
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}",
        json.dumps(
            {
                "conn_type": "aws",
                "login": moto_server.access_key_id,
                "password": moto_server.secret_access_key,
                "extra": {"endpoint_url": moto_server.endpoint},
            }
        ),
    )


def test_an_ecr_registry_gets_a_fresh_password_from_ecr_each_time(monkeypatch, moto_server):
    """ECR's password lasts 12 hours: the hook asks ECR (the amazon provider's EcrHook, against moto's ECR)."""
    _aws_conn(monkeypatch, moto_server)
    hook = RegistryHook(set_conn(monkeypatch, "reg_ecr", host=ECR))
    s = hook.settings
    assert (s.registry, s.username, s.password) == (ECR, "AWS", "123456789012-auth-token")
    assert hook.docker_config() == {
        "auths": {ECR: {"auth": base64.b64encode(b"AWS:123456789012-auth-token").decode()}}
    }
    # a connection named in the extra
    _aws_conn(monkeypatch, moto_server, "aws_ecr_pushes")
    monkeypatch.delenv("AIRFLOW_CONN_AWS_DEFAULT")
    hook = RegistryHook(
        set_conn(monkeypatch, "reg_ecr2", host=f"https://{ECR}", extra={"aws_conn_id": "aws_ecr_pushes"})
    )
    assert hook.settings.password == "123456789012-auth-token"
    # a password in the connection is the user's choice, kept as it is
    hook = RegistryHook(set_conn(monkeypatch, "reg_ecr3", host=ECR, login="AWS", password="pasted"))
    assert hook.settings.password == "pasted"


@pytest.mark.parametrize(
    ("conn", "message"),
    [
        (
            {"host": "registry.example.com", "extra": {"aws_conn_id": "aws_default"}},
            "extra aws_conn_id='aws_default' asks ECR for a password, but host 'registry.example.com' is not an ECR registry",
        ),
        (
            {"host": ECR, "login": "AWS", "password": "p", "extra": {"aws_conn_id": "aws_default"}},
            "cannot be combined with a password or token: ECR gives the password",
        ),
    ],
)
def test_ecr_settings_that_contradict_fail_naming_them(monkeypatch, conn, message):
    with pytest.raises(ValueError, match=message):
        _ = RegistryHook(set_conn(monkeypatch, "reg_ecr_bad", **conn)).settings


def test_refused_credentials_fail_the_digest_lookup_with_a_retry(monkeypatch, tmp_path):
    """A token that expired (ECR's after 12 hours) is renewed between tries: the lookup's failure is retried."""
    from airflow.sdk.exceptions import AirflowFailException

    from kubetrain.images import ImageResolutionError, pin_image

    reg = start_registry(tmp_path / "reg", users={"ci": "good"})
    try:
        set_conn(
            monkeypatch,
            "reg_expired",
            host="127.0.0.1",
            port=reg.port,
            login="ci",
            password="expired",
            extra={"insecure": True},
        )
        image = f"127.0.0.1:{reg.port}/kubetrain/trainer:latest"
        with pytest.raises(
            ImageResolutionError, match="refused the credentials of user 'ci'.*renew it"
        ) as err:
            pin_image(image, registry_conn_id="reg_expired")
        # the password ("expired") is never shown; the connection's id is
        shown = str(err.value).replace("connection 'reg_expired'", "")
        assert not isinstance(err.value, AirflowFailException) and "expired" not in shown
    finally:
        reg.stop()


# -- Google Artifact Registry: logins from Application Default Credentials, renewed at each use ---------

AR = "europe-west4-docker.pkg.dev/ml-project/kubetrain"


@pytest.fixture
def google_credentials(monkeypatch, tmp_path):
    """A service account key whose token endpoint is a local server issuing a new token per request (Google's
    own endpoint is out of reach here): google-auth signs the JWT grant and exchanges it as it would at Google."""
    import http.server
    import itertools
    import threading
    import urllib.parse

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    counter = itertools.count(1)
    grants: list[dict] = []

    class TokenEndpoint(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"])).decode()
            grants.append(dict(urllib.parse.parse_qsl(body)))
            payload = json.dumps({"access_token": f"ya29.token-{next(counter)}", "expires_in": 3599}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TokenEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    info = {
        "type": "service_account",
        "project_id": "ml-project",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "kubetrain-builds@ml-project.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": f"http://127.0.0.1:{server.server_address[1]}/token",
    }
    path = tmp_path / "adc.json"
    path.write_text(json.dumps(info))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    yield grants
    server.shutdown()


def test_an_artifact_registry_login_is_renewed_each_time(monkeypatch, google_credentials):
    """A pasted `gcloud auth print-access-token` lasts an hour; the hook asks Google's credentials each time."""
    first = RegistryHook(set_conn(monkeypatch, "reg_ar", host=AR)).settings
    assert (first.registry, first.username, first.password) == (AR, "oauth2accesstoken", "ya29.token-1")
    second = RegistryHook(set_conn(monkeypatch, "reg_ar", host=AR)).settings
    assert second.password == "ya29.token-2"
    assert google_credentials[0]["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
    hook = RegistryHook(set_conn(monkeypatch, "reg_ar", host=AR))
    auth = base64.b64decode(hook.docker_config()["auths"]["europe-west4-docker.pkg.dev"]["auth"]).decode()
    assert auth == "oauth2accesstoken:ya29.token-3"
    # a password in the connection is the user's choice, kept as it is
    pasted = RegistryHook(set_conn(monkeypatch, "reg_ar2", host=AR, login="oauth2accesstoken", password="p"))
    assert pasted.settings.password == "p" and len(google_credentials) == 3


@pytest.mark.parametrize(
    ("conn", "message"),
    [
        (
            {"host": "registry.example.com", "extra": {"google_auth": True}},
            "extra google_auth asks Google for a login, but host 'registry.example.com' is not an Artifact Registry",
        ),
        (
            {"host": AR, "password": "p", "extra": {"google_auth": True}},
            "google_auth cannot be combined with a password or token",
        ),
    ],
)
def test_google_settings_that_contradict_fail_naming_them(monkeypatch, conn, message):
    with pytest.raises(ValueError, match=message):
        _ = RegistryHook(set_conn(monkeypatch, "reg_ar_bad", **conn)).settings


def test_without_google_auth_installed_the_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "google.auth", None)
    with pytest.raises(ValueError, match=r"install kubetrain\[gcp\]"):
        _ = RegistryHook(set_conn(monkeypatch, "reg_ar_none", host=AR)).settings


def test_without_credentials_the_error_says_where_they_come_from(monkeypatch, tmp_path):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="Workload Identity.*GOOGLE_APPLICATION_CREDENTIALS"):
        _ = RegistryHook(set_conn(monkeypatch, "reg_ar_nocreds", host=AR)).settings
