"""RegistryHook: a container registry reached through an Airflow connection.

The connection (conn_type ``kubetrain_registry``; a ``docker`` connection works too) holds
the registry's host and port (the host may carry the path under which the repositories live, as
Artifact Registry's ``europe-west4-docker.pkg.dev/<project>/<repository>``), a login and
password, and these extras:

* ``insecure`` (bool): plain HTTP, for development registries on a trusted network;
* ``tls_verify`` (bool, default true): verify the registry's TLS certificate;
* ``ca_bundle`` (path): a CA bundle for registries with a private CA;
* ``token`` (str): a ready Bearer token, instead of login/password;
* ``timeout`` (seconds): per request;
* ``aws_conn_id`` (str): for Amazon ECR, the AWS connection through which the hook asks ECR for a
  fresh password each time it is used (the amazon provider's ``EcrHook``): an ECR password lasts
  12 hours, so one pasted into the connection breaks every later digest lookup and push. An ECR
  host (``<account>.dkr.ecr.<region>.amazonaws.com``) without a password uses ``aws_default``.
* ``google_auth`` (bool): for Google Artifact Registry (``<region>-docker.pkg.dev``, ``gcr.io``), log in
  as ``oauth2accesstoken`` with a fresh access token of Google's Application Default Credentials
  (Workload Identity on GKE, ``GOOGLE_APPLICATION_CREDENTIALS`` elsewhere) each time the hook is used,
  through google-auth (``pip install 'kubetrain[gcp]'``): a pasted ``gcloud auth print-access-token``
  lasts about an hour. An Artifact Registry host without a password or token does so by default.

A scheme in the host (``https://registry.example.com``) also says HTTP or HTTPS. Arguments
given to the hook beat the extras; settings that contradict each other raise ``ValueError``.

Example, as an environment variable::

    AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT='{"conn_type": "kubetrain_registry",
        "host": "registry.example.com", "login": "ci", "password": "...", "extra": {"ca_bundle": "/etc/ssl/ca.pem"}}'
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from kubetrain.provider_info import REGISTRY_CONN_TYPE, REGISTRY_FIELD_BEHAVIOUR, REGISTRY_HOOK_NAME

if TYPE_CHECKING:
    from kubetrain.imagebuild.oci import RegistryClient

_TRUE = {"1", "true", "yes", "on"}
# Amazon ECR's private registries: <account>.dkr.ecr[-fips].<region>.amazonaws.com[.cn]
ECR_HOST = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?(?::\d+)?$"
)
_FALSE = {"0", "false", "no", "off", ""}
# Google Artifact Registry's Docker hosts (<region>-docker.pkg.dev) and the gcr.io domains it serves
GOOGLE_HOST = re.compile(r"^(?:[a-z0-9-]+-docker\.pkg\.dev|(?:[a-z]+\.)?gcr\.io)(?::\d+)?$")
GOOGLE_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)


def _as_bool(value: Any, name: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"invalid {name} {value!r}: expected true or false")


@dataclass(frozen=True)
class RegistrySettings:
    """Resolved registry settings; ``__post_init__`` refuses contradictions, naming both sides."""

    registry: str
    insecure: bool = False
    tls_verify: bool = True
    ca_bundle: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    timeout: float = 60.0

    def __post_init__(self) -> None:
        from kubetrain.imagebuild.reference import split_registry

        split_registry(self.registry)
        if self.insecure and self.ca_bundle:
            raise ValueError(
                f"insecure=True (plain HTTP) cannot be combined with ca_bundle={self.ca_bundle!r} (a TLS setting): "
                "choose one"
            )
        if not self.tls_verify and self.ca_bundle:
            raise ValueError(
                f"tls_verify=False cannot be combined with ca_bundle={self.ca_bundle!r}: a CA bundle only matters "
                "when certificates are verified"
            )
        if self.token and self.password:
            raise ValueError(
                "token cannot be combined with a password: the connection must give one or the other"
            )
        if self.ca_bundle and not Path(self.ca_bundle).is_file():
            raise ValueError(f"ca_bundle {self.ca_bundle!r} does not exist: expected a PEM file")
        if self.timeout <= 0:
            raise ValueError(f"invalid timeout {self.timeout!r}: expected a positive number of seconds")

    @property
    def verify(self) -> bool | str:
        return self.ca_bundle or self.tls_verify


class RegistryHook(BaseHook):
    """Interact with a container registry (OCI distribution API).

    :param registry_conn_id: the Airflow connection of the registry.
    :param insecure: plain HTTP instead of HTTPS; beats the ``insecure`` extra.
    :param tls_verify: verify TLS certificates; beats the ``tls_verify`` extra.
    :param ca_bundle: path of a CA bundle; beats the ``ca_bundle`` extra.
    :param token: a Bearer token; beats the ``token`` extra.
    :param timeout: seconds per request; beats the ``timeout`` extra.
    """

    conn_name_attr = "registry_conn_id"
    default_conn_name = "kubetrain_registry_default"
    conn_type = REGISTRY_CONN_TYPE
    hook_name = REGISTRY_HOOK_NAME

    def __init__(
        self,
        registry_conn_id: str = default_conn_name,
        *,
        insecure: bool | None = None,
        tls_verify: bool | None = None,
        ca_bundle: str | None = None,
        token: str | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.registry_conn_id = registry_conn_id
        self._explicit = {
            "insecure": insecure,
            "tls_verify": tls_verify,
            "ca_bundle": ca_bundle,
            "token": token,
            "timeout": timeout,
        }

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        # declared in provider_info, which Airflow reads without importing this module
        return copy.deepcopy(REGISTRY_FIELD_BEHAVIOUR)

    @cached_property
    def settings(self) -> RegistrySettings:
        """The registry settings from the connection, its extras and the hook's arguments."""
        conn = self.get_connection(self.registry_conn_id)
        extra = conn.extra_dejson or {}
        host = (conn.host or "").strip()
        scheme = None
        for prefix in ("https://", "http://"):
            if host.lower().startswith(prefix):
                scheme, host = prefix[:-3], host[len(prefix) :]
        host = host.rstrip("/")
        if not host:
            raise ValueError(
                f"connection {self.registry_conn_id!r} has no host: expected the registry's host name"
            )
        name, slash, path = host.partition("/")
        if conn.port and ":" not in name:
            host = f"{name}:{conn.port}{slash}{path}"

        def pick(name: str) -> Any:
            return self._explicit[name] if self._explicit[name] is not None else extra.get(name)

        insecure = _as_bool(pick("insecure"), "insecure")
        if scheme and insecure is not None and insecure != (scheme == "http"):
            source = "argument" if self._explicit["insecure"] is not None else "extra"
            raise ValueError(
                f"connection {self.registry_conn_id!r}: host {conn.host!r} says {scheme.upper()} but the insecure "
                f"{source} says insecure={insecure}: drop one of them"
            )
        tls_verify = _as_bool(pick("tls_verify"), "tls_verify")
        timeout = pick("timeout")
        username, password = conn.login or None, conn.password or None
        ecr = ECR_HOST.match(host.partition("/")[0])
        aws_conn_id = extra.get("aws_conn_id") or (
            "aws_default" if ecr and not password and not pick("token") else None
        )
        if aws_conn_id:
            if not ecr:
                raise ValueError(
                    f"connection {self.registry_conn_id!r}: extra aws_conn_id={aws_conn_id!r} asks ECR for "
                    f"a password, but host {host!r} is not an ECR registry (<account>.dkr.ecr.<region>"
                    ".amazonaws.com)"
                )
            if password or pick("token"):
                raise ValueError(
                    f"connection {self.registry_conn_id!r}: extra aws_conn_id={aws_conn_id!r} cannot be "
                    "combined with a password or token: ECR gives the password"
                )
            username, password = self._ecr_login(aws_conn_id, ecr["account"], ecr["region"])
        google = GOOGLE_HOST.match(host.partition("/")[0])
        google_auth = _as_bool(extra.get("google_auth"), "google_auth")
        if google_auth is None:
            google_auth = bool(google) and not password and not pick("token")
        if google_auth:
            if not google:
                raise ValueError(
                    f"connection {self.registry_conn_id!r}: extra google_auth asks Google for a login, but host "
                    f"{host!r} is not an Artifact Registry host (<region>-docker.pkg.dev, gcr.io)"
                )
            if password or pick("token"):
                raise ValueError(
                    f"connection {self.registry_conn_id!r}: extra google_auth cannot be combined with a password "
                    "or token: Google's credentials give the password"
                )
            username, password = self._google_login(self.registry_conn_id, host)
        self._credential_origin = (
            "ecr" if ecr else "artifact-registry" if google else "other",
            bool(aws_conn_id or google_auth),
            aws_conn_id,
        )
        return RegistrySettings(
            registry=host,
            insecure=insecure if insecure is not None else scheme == "http",
            tls_verify=True if tls_verify is None else tls_verify,
            ca_bundle=pick("ca_bundle") or None,
            username=username,
            password=password,
            token=pick("token") or None,
            timeout=float(timeout) if timeout not in (None, "") else 60.0,
        )

    @staticmethod
    def _ecr_login(aws_conn_id: str, account: str, region: str) -> tuple[str, str]:
        """A fresh ECR login (``AWS`` and a 12-hour password) through the amazon provider's ``EcrHook``."""
        from airflow.providers.amazon.aws.hooks.ecr import EcrHook

        credentials = EcrHook(aws_conn_id=aws_conn_id, region_name=region).get_temporary_credentials(
            registry_ids=[account]
        )
        return credentials[0].username, credentials[0].password

    @staticmethod
    def _google_login(conn_id: str, host: str) -> tuple[str, str]:
        """A fresh Artifact Registry login (``oauth2accesstoken`` and an access token of about an hour) from
        Google's Application Default Credentials, through google-auth."""
        try:
            import google.auth
            import google.auth.exceptions
            import google.auth.transport.requests
        except ImportError:
            raise ValueError(
                f"connection {conn_id!r}: host {host!r} is Google Artifact Registry, whose logins are renewed "
                "through google-auth: install kubetrain[gcp] (pip install 'kubetrain[gcp]'), or give a password "
                "(a `gcloud auth print-access-token` token lasts about an hour)"
            ) from None
        try:
            credentials, _ = google.auth.default(scopes=list(GOOGLE_SCOPES))
            credentials.refresh(google.auth.transport.requests.Request())
        except google.auth.exceptions.GoogleAuthError as exc:
            raise ValueError(
                f"connection {conn_id!r}: no access token for Artifact Registry host {host!r} from Google's "
                f"Application Default Credentials ({exc}): on GKE, bind the pod's service account to a Google "
                "service account (Workload Identity); elsewhere set GOOGLE_APPLICATION_CREDENTIALS"
            ) from None
        return "oauth2accesstoken", credentials.token

    @property
    def registry(self) -> str:
        """``host[:port][/path]`` of the registry: what the names of its images start with."""
        return self.settings.registry

    def get_conn(self) -> RegistryClient:
        """A new OCI distribution client for this registry."""
        from kubetrain.imagebuild.oci import RegistryClient

        s = self.settings
        options = {
            name: getattr(s, name) for name in ("insecure", "username", "password", "token", "timeout")
        }
        from kubetrain.imagebuild.oci_auth import CredentialOrigin

        client = RegistryClient(s.registry, verify=s.verify, **options)
        kind, renewed, aws_conn_id = getattr(self, "_credential_origin", ("other", False, None))
        # what the error about refused or expired credentials names (the connection, never the secret)
        client.credential_origin = CredentialOrigin(self.registry_conn_id, kind, renewed, aws_conn_id)
        return client

    def test_connection(self) -> tuple[bool, str]:
        """Check that the registry answers ``GET /v2/`` with these credentials."""
        from kubetrain.imagebuild.registry_errors import RegistryError

        try:
            with self.get_conn() as client:
                client.ping()
        except (RegistryError, ValueError) as exc:
            return False, str(exc)
        return True, f"registry {self.registry} accepted the connection"

    def docker_config(self) -> dict[str, Any]:
        """The Docker config (``config.json`` / ``.dockerconfigjson``) that grants access to this registry."""
        s = self.settings
        if s.token:
            entry: dict[str, str] = {"registrytoken": s.token}
        elif s.username:
            entry = {"auth": base64.b64encode(f"{s.username}:{s.password or ''}".encode()).decode()}
        else:
            return {"auths": {}}
        from kubetrain.imagebuild.reference import split_registry

        return {"auths": {split_registry(s.registry)[0]: entry}}

    def write_authfile(self, path: Path) -> Path:
        """Write the Docker config for buildah and skopeo (``--authfile``), readable by the owner only.

        :raises ValueError: when the connection holds a token, which buildah cannot send as is.
        """
        if self.settings.token:
            raise ValueError(
                f"connection {self.registry_conn_id!r} gives a token, but buildah needs a login and password "
                "(use the token as the password where the registry allows it)"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(self.docker_config(), fh)
        return path
