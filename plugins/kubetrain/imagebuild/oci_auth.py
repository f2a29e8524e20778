"""The registry client's credentials: Basic, or a Bearer token from the registry's token service.

The registry's ``WWW-Authenticate`` challenge says which; a Bearer token is fetched once per set of
scopes, from a realm checked like any other target (:meth:`RequestTargets.check_realm`).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping

import requests

from kubetrain.imagebuild.oci_targets import shown_url
from kubetrain.imagebuild.registry_errors import (
    RegistryAuthError,
    RegistryUnreachable,
    TargetRefused,
    error_detail,
)

_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """Split ``Bearer realm="...",service="..."`` into ``("bearer", {...})``."""
    scheme, _, params = header.strip().partition(" ")
    return scheme.lower(), dict(_CHALLENGE_PARAM.findall(params))


class RegistryAuth:
    """The auth half of :class:`kubetrain.imagebuild.oci.RegistryClient`: the header each request carries.

    A mixin: it uses the client's ``registry``, ``username``, ``_password``, ``_token``, ``_challenge``,
    ``_bearer``, ``stats``, ``check_realm``, ``_send`` and ``_redirect_url``.
    """

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
        return token
