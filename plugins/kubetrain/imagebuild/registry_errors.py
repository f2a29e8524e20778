"""The errors of the registry client (:mod:`kubetrain.imagebuild.oci`), and how its messages show an answer."""

from __future__ import annotations

import requests


class RegistryError(RuntimeError):
    """The registry refused a request or answered something unexpected."""


class RegistryAuthError(RegistryError):
    """The registry wants credentials, or refused the ones given."""


class TargetRefused(RegistryError):
    """The registry pointed the client at a URL it does not send to (a redirect, an upload Location, a realm);
    nothing was sent there."""


class RealmRefused(RegistryAuthError, TargetRefused):
    """The registry pointed its Bearer realm outside its own host and the trusted token services."""


class RegistryUnreachable(RegistryError):
    """No HTTP answer from the registry (connection refused, DNS, TLS, timeout)."""


class ManifestNotFound(RegistryError):
    """The repository has no manifest under that tag or digest."""


def error_detail(response: requests.Response) -> str:
    """The registry's error codes and messages (the distribution spec's ``errors``, or OAuth's ``error``), never
    the raw body: a body that is neither is described, not echoed (it may come from anywhere a server points)."""
    text = ""
    try:
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("errors"), list):
            text = "; ".join(
                f"{e.get('code', '?')}: {e.get('message', '')}".strip()
                for e in body["errors"]
                if isinstance(e, dict)
            )
        elif isinstance(body, dict) and isinstance(body.get("error"), str):
            text = body["error"] + (
                f": {body['error_description']}" if isinstance(body.get("error_description"), str) else ""
            )
    except ValueError:
        pass
    if not text and response.content:
        kind = response.headers.get("Content-Type", "").split(";")[0].strip() or "unknown type"
        text = f"(a {kind} body of {len(response.content)} bytes, not shown)"
    text = " ".join(text.split())[:200]
    return f"HTTP {response.status_code}" + (f" {text}" if text else "")
