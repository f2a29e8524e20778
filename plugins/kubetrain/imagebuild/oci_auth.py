"""The registry client's credentials: Basic, or a Bearer token from the registry's token service.

The registry's ``WWW-Authenticate`` challenge says which; a Bearer token is fetched once per set of
scopes, from a realm checked like any other target (:meth:`RequestTargets.check_realm`).

Credentials expire: a pasted ECR password after 12 hours, a ``gcloud auth print-access-token`` token after
about an hour, a registry token at its ``exp``. When the registry (or its token service) answers 401 to
credentials that carry an expiry in the past, or that it accepted earlier in this client's life, the error
says they expired and how to renew them for that kind of registry (:class:`CredentialOrigin`, set by
:class:`kubetrain.hooks.registry.RegistryHook`), naming the connection and never the secret.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import requests

from kubetrain.imagebuild.oci_targets import shown_url
from kubetrain.imagebuild.registry_errors import (
    RegistryAuthError,
    RegistryUnreachable,
    TargetRefused,
    error_detail,
)

if TYPE_CHECKING:  # oci imports this module
    from kubetrain.imagebuild.oci import TransferStats

_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class CredentialOrigin:
    """Where a client's credentials come from: what the error about refused credentials names.

    :param conn_id: the Airflow connection.
    :param kind: ``ecr`` (Amazon ECR), ``artifact-registry`` (Google Artifact Registry, gcr.io) or ``other``.
    :param renewed: the hook fetched them fresh for this use (ECR through the amazon provider, Artifact
        Registry through google-auth) rather than reading them from the connection.
    :param aws_conn_id: the AWS connection of a renewed ECR login.
    """

    conn_id: str
    kind: str = "other"
    renewed: bool = False
    aws_conn_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("ecr", "artifact-registry", "other"):
            raise ValueError(f"kind {self.kind!r} is not valid: expected ecr, artifact-registry or other")

    def renewal(self, registry: str) -> str:
        """How to renew the credentials, or, for those the hook renews itself, what failed."""
        conn = f"connection {self.conn_id!r}"
        if self.kind == "ecr" and self.renewed:
            return (
                f"{conn} gets a fresh ECR password through the amazon provider (AWS connection "
                f"{self.aws_conn_id!r}) each time it is used, so the one fetched for this task ran out during it "
                "(ECR passwords last 12 hours) or was revoked: check that the AWS identity can still call "
                "ecr:GetAuthorizationToken and use this repository, and retry the task"
            )
        if self.kind == "ecr":
            return (
                f"a pasted ECR password lasts 12 hours: remove the password from {conn} so that the hook asks "
                "ECR for a fresh one each time it is used (through the amazon provider; extra aws_conn_id, "
                "default aws_default)"
            )
        if self.kind == "artifact-registry" and self.renewed:
            return (
                f"{conn} gets a fresh access token from Google's Application Default Credentials each time it is "
                "used, so the one fetched for this task ran out during it (they last about an hour) or was "
                "revoked: check the identity's Artifact Registry roles, and retry the task"
            )
        if self.kind == "artifact-registry":
            return (
                "a `gcloud auth print-access-token` token lasts about an hour: install kubetrain[gcp] "
                f"(pip install 'kubetrain[gcp]') and remove the password from {conn}, so that the hook gets a "
                "fresh token from Google's Application Default Credentials each time it is used (extra "
                "google_auth)"
            )
        return f"update the password (or token) of {conn} with current credentials for registry {registry}"


def _b64json(text: str) -> object:
    padded = text + "=" * (-len(text) % 4)
    return json.loads(base64.urlsafe_b64decode(padded.replace("+", "-").replace("/", "_")))


def credential_expiry(secret: str | None) -> datetime | None:
    """The expiry a credential carries, if it says: a JWT's ``exp`` (registry tokens), or the ``expiration`` of
    an ECR password (base64 of a JSON document). Read without verifying anything: it only explains a refusal."""
    if not secret:
        return None
    candidates = []
    parts = secret.split(".")
    if len(parts) == 3:
        candidates.append((parts[1], "exp"))
    candidates.append((secret, "expiration"))
    for text, key in candidates:
        try:
            doc = _b64json(text)
        except (ValueError, TypeError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get(key), int | float) and not isinstance(doc[key], bool):
            try:
                return datetime.fromtimestamp(doc[key], UTC)
            except (OverflowError, OSError, ValueError):
                return None
    return None


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """Split ``Bearer realm="...",service="..."`` into ``("bearer", {...})``."""
    scheme, _, params = header.strip().partition(" ")
    return scheme.lower(), dict(_CHALLENGE_PARAM.findall(params))


class RegistryAuth:
    """The auth half of :class:`kubetrain.imagebuild.oci.RegistryClient`: the header each request carries.

    A mixin: it uses the client's ``registry``, ``username``, ``_password``, ``_token``, ``_challenge``,
    ``_bearer``, ``stats``, ``check_realm``, ``_send`` and ``_redirect_url``.
    """

    # the host's attributes this mixin uses (RegistryClient.__init__ sets them)
    registry: str
    username: str | None
    _password: str | None
    _token: str | None
    _challenge: tuple[str, dict[str, str]] | None
    _bearer: dict[tuple[str, ...], str]
    stats: TransferStats

    if TYPE_CHECKING:  # the host's methods (RequestTargets has them)

        def check_realm(
            self,
            realm: str,
            *,
            params: Sequence[tuple[str, str]] | None = None,
            auth: tuple[str, str] | None = None,
        ) -> requests.PreparedRequest: ...

        def _send(self, prepared: requests.PreparedRequest) -> requests.Response: ...

        def _redirect_url(self, response: requests.Response) -> str: ...

    #: where the credentials come from (the hook sets it), for the error that says how to renew them
    credential_origin: CredentialOrigin | None = None
    #: the registry (or its token service) has accepted these credentials in this client's life
    _credentials_accepted: bool = False

    def _credentials_sent(self) -> bool:
        return bool(self._token) or (self._challenge is not None and bool(self.username))

    def _note_accepted(self) -> None:
        """A request with these credentials succeeded: a later 401 means they expired or were revoked."""
        if self._credentials_sent():
            self._credentials_accepted = True

    def _expired_because(self) -> str | None:
        """Why the credentials look expired (their own expiry is past; they were accepted earlier), else None."""
        expiry = credential_expiry(self._token or self._password)
        if expiry is not None and expiry <= datetime.now(UTC):
            return f"they carry an expiry, {expiry:%Y-%m-%d %H:%M:%S} UTC, that is past"
        if self._credentials_accepted:
            return "the registry accepted them earlier in this task and refuses them now"
        return None

    def _renewal(self) -> str:
        if self.credential_origin is not None:
            return self.credential_origin.renewal(self.registry)
        return f"renew the credentials given for registry {self.registry}"

    def refused_credentials(
        self, refused_by: str, target: str, response: requests.Response
    ) -> RegistryAuthError:
        """The error for a 401 to credentials that were sent: expired (with how to renew them) when they look
        so, else refused; never with the secret.

        :param refused_by: who answered (``registry X``, ``token service Y of registry X``).
        """
        why = self._expired_because()
        if why is not None:
            return RegistryAuthError(
                f"{refused_by} refused the credentials of {self._who()} for {target} ({error_detail(response)}): "
                f"they have expired ({why}); {self._renewal()}"
            )
        text = (
            f"{refused_by} refused the credentials of {self._who()} for {target} ({error_detail(response)})"
        )
        origin = self.credential_origin
        if origin is not None and origin.kind != "other" and not origin.renewed:
            text += f"; if they worked before, they may have expired: {self._renewal()}"
        elif origin is not None:
            text += f": check the login and password of connection {origin.conn_id!r}"
        return RegistryAuthError(text)

    def _who(self) -> str:
        if self._token:
            return "the configured token"
        return f"user {self.username!r}" if self.username else "anonymous access"

    def _auth_header(self, scopes: tuple[str, ...], refresh: bool = False) -> dict[str, str]:
        if self._token:
            return {"Authorization": f"Bearer {self._token}"}
        if self._challenge is None:
            return {}
        scheme, params = self._challenge
        if scheme == "basic":
            if not self.username:
                return {}
            raw = f"{self.username}:{self._password or ''}".encode()
            return {"Authorization": "Basic " + base64.b64encode(raw).decode()}
        if scheme == "bearer":
            if refresh or scopes not in self._bearer:
                self._bearer[scopes] = self._fetch_token(params, scopes)
            return {"Authorization": f"Bearer {self._bearer[scopes]}"}
        raise RegistryAuthError(
            f"registry {self.registry} asks for {scheme!r} auth; expected Basic or Bearer"
        )

    def _fetch_token(self, params: Mapping[str, str], scopes: tuple[str, ...]) -> str:
        realm = params.get("realm")
        if not realm:
            raise RegistryAuthError(f"registry {self.registry} sent a Bearer challenge without a realm")
        query: list[tuple[str, str]] = [("service", params["service"])] if params.get("service") else []
        query += [("scope", s) for s in scopes]
        auth = (self.username, self._password or "") if self.username else None
        prepared = self.check_realm(realm, params=query, auth=auth)
        try:
            resp = self._send(prepared)
        except requests.RequestException as exc:
            raise RegistryUnreachable(
                f"token service {realm} of registry {self.registry} is unreachable: {exc}"
            ) from exc
        self.stats.requests += 1
        if resp.is_redirect:
            raise TargetRefused(
                f"token service {realm} of registry {self.registry} redirected the token request (HTTP "
                f"{resp.status_code}) to {shown_url(self._redirect_url(resp))}: refused, nothing was sent there "
                "(a token service must answer itself)"
            )
        if resp.status_code == 401 and self.username and self._expired_because():
            raise self.refused_credentials(
                f"token service {realm} of registry {self.registry}", "a token", resp
            )
        if resp.status_code in (401, 403):
            raise RegistryAuthError(
                f"token service {realm} of registry {self.registry} refused {self._who()} ({error_detail(resp)})"
            )
        if resp.status_code != 200:
            raise RegistryAuthError(
                f"token service {realm} of registry {self.registry} failed: {error_detail(resp)}"
            )
        body = resp.json()
        token = body.get("token") or body.get("access_token")
        if not token:
            raise RegistryAuthError(
                f"token service {realm} of registry {self.registry} answered without a token"
            )
        if self.username:
            self._credentials_accepted = True
        return token
