"""Where the registry client's requests go, and the redirects it follows.

A registry may be named in a Param, so what it answers must not steer the worker
elsewhere (issue #53). Every request is prepared first (``Session.prepare_request``) and checked on the URL
the HTTP client will send, read the way urllib3 reads it (``urllib3.util.parse_url``), and then exactly that
request is sent; a URL that ``urllib.parse.urlsplit`` reads with another host or port
(``http://a:1\\@b:2/``) is refused outright. Its host must be the registry's own, a service the registry is
known to use (:data:`KNOWN_SERVICES`) or one the ``token_services`` setting trusts; only requests to the
registry's own host carry our ``Authorization``. requests never follows a redirect here: the client follows
one itself only where the distribution spec expects it (blob downloads, which registries send to their
storage), at most :data:`MAX_REDIRECTS` hops, each checked as above; every other redirect, and an upload
``Location`` outside those hosts, is refused before anything is sent there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

import requests
from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

from kubetrain.imagebuild.registry_errors import RealmRefused, RegistryUnreachable, TargetRefused

if TYPE_CHECKING:  # oci imports this module
    from kubetrain.imagebuild.oci import TransferStats

# The one table of hosts a registry is known to send its clients to besides its own: its token service (the
# Bearer realm) and the storage its blob downloads redirect to. Keyed by the registry's host; a '*' stands
# for part of one DNS label (fnmatch, label by label); each host is trusted over HTTPS on port 443 only.
# Others come from the token_services setting. Artifact Registry (<region>-docker.pkg.dev) redirects blobs
# to its own host (relative Locations) and needs no row; gcr.io and GHCR's token services are on their own
# hosts.
KNOWN_SERVICES: dict[str, tuple[str, ...]] = {
    "registry-1.docker.io": (
        "auth.docker.io",
        "production.cloudflare.docker.com",
        "production.cloudfront.docker.com",
        "docker-images-prod.6aa30f8b08e16409b46e0173d6de2f56.r2.cloudflarestorage.com",
    ),
    "*.dkr.ecr.*.amazonaws.com": (
        "prod-*-starport-layer-bucket.s3.*.amazonaws.com",
        "prod-*-starport-layer-bucket.s3.amazonaws.com",
    ),
    "gcr.io": ("storage.googleapis.com",),
    "*.gcr.io": ("storage.googleapis.com",),
    "ghcr.io": ("pkg-containers.githubusercontent.com",),
}
#: hops a blob download may take (containerd and Go's net/http allow 10; registries use one)
MAX_REDIRECTS = 5


def endpoint(url: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of ``url`` as urllib3, which requests sends with, reads it (an IPv6 host in
    brackets); None when it is not an http(s) URL with a host."""
    try:
        parts = parse_url(url)
    except LocationParseError:
        return None
    scheme = (parts.scheme or "").lower()
    if scheme not in ("http", "https") or not parts.host:
        return None
    return scheme, parts.host.lower(), parts.port or (443 if scheme == "https" else 80)


def _splitendpoint(url: str) -> tuple[str, str, int] | None:
    """:func:`_endpoint` by ``urllib.parse.urlsplit``'s reading, to refuse a URL the two read apart."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not host:
        return None
    return scheme, f"[{host}]" if ":" in host else host, port or (443 if scheme == "https" else 80)


def _hostport(where: tuple[str, str, int] | None) -> str:
    return f"{where[1]}:{where[2]}" if where else "no http(s) host"


def shown_url(url: str) -> str:
    """``url`` for a message: no credentials, query or fragment (a storage URL's query is a signature)."""
    try:
        text = parse_url(url)._replace(auth=None, query=None, fragment=None).url
    except LocationParseError:
        text = repr(url)
    return text if len(text) <= 200 else text[:200] + "..."


def _subject(kind: str, target: str) -> tuple[str, str, str]:
    """How messages name a URL the registry chose: (what it is, whose it is, what a trusted host would be)."""
    return {
        "realm": ("a Bearer realm", "its Bearer realm", "token service"),
        "redirect": (f"a redirect of {target}", f"its redirect of {target}", "blob storage"),
        "location": (f"an upload Location for {target}", f"the upload Location for {target}", "upload host"),
    }[kind]


def _host_matches(pattern: str, host: str) -> bool:
    """``host`` against a :data:`KNOWN_SERVICES` pattern, label by label ('*' never spans a dot)."""
    labels, wanted = host.lower().split("."), pattern.lower().split(".")
    return len(labels) == len(wanted) and all(map(fnmatchcase, labels, wanted))


class RequestTargets:
    """The requests of :class:`kubetrain.imagebuild.oci.RegistryClient`: each prepared, checked, sent as prepared.

    A mixin: it uses the client's ``registry``, ``base_url``, ``timeout``, ``stats``, ``_session``,
    ``_own`` (the registry's endpoint), ``_token_services`` and ``_auth_header(scopes, refresh)``.
    """

    # the host's attributes this mixin uses (RegistryClient.__init__ sets them)
    registry: str
    base_url: str
    timeout: float
    stats: TransferStats
    _session: requests.Session
    _own: tuple[str, str, int]
    _token_services: Sequence[str] | None

    if TYPE_CHECKING:  # the host's method (RegistryAuth has it)

        def _auth_header(self, scopes: tuple[str, ...], refresh: bool = False) -> dict[str, str]: ...

    def _trusted(self) -> list[str]:
        """The ``token_services`` entries: the argument, else the setting."""
        if self._token_services is not None:
            return list(self._token_services)
        from kubetrain import settings

        return list(settings.parse_list("token_services", settings.get("token_services")))

    def _allows(self, where: tuple[str, str, int], url: str) -> bool:
        """Whether a request to ``url`` (prepared; ``where`` its endpoint) may be sent: the registry's own
        host, a host of :data:`KNOWN_SERVICES` for this registry, or a ``token_services`` entry."""
        if where == self._own:
            return True
        scheme, host, port = where
        known = [h for r, hosts in KNOWN_SERVICES.items() if _host_matches(r, self._own[1]) for h in hosts]
        if (scheme, port) == ("https", 443) and any(_host_matches(pattern, host) for pattern in known):
            return True
        for entry in self._trusted():
            entry = entry.strip()
            if "://" in entry:  # a URL prefix: its endpoint, and the path under its path
                prefix = (parse_url(entry).path or "").rstrip("/") if endpoint(entry) else ""
                path = parse_url(url).path or "/"
                if endpoint(entry) == where and (path == prefix or path.startswith(prefix + "/")):
                    return True
            elif endpoint(f"https://{entry}") == where:  # a bare host[:port] is trusted over HTTPS only
                return True
        return False

    def _vet(self, url: str, prepared: requests.PreparedRequest, kind: str, target: str = "") -> bool:
        """Check where ``prepared`` (made from ``url``, which the registry chose) would go before it is sent;
        True when that is the registry's own host (the only one our credentials go to).

        :param kind: ``realm``, ``redirect`` (of a blob download) or ``location`` (of an upload).
        :param target: the request it belongs to, for messages.
        :raises TargetRefused: (:class:`RealmRefused` for a realm) naming the registry and the URL.
        """
        subject, its, service = _subject(kind, target)
        refuse = RealmRefused if kind == "realm" else TargetRefused
        where = endpoint(prepared.url or "")
        if where is None:
            raise refuse(f"registry {self.registry} sent {subject} that is not an http(s) URL: refused")
        read = _splitendpoint(url)
        if read != where:  # urlsplit and urllib3 disagree: no check made with one may decide for the other
            shown = repr(url) if len(url) <= 200 else repr(url[:200]) + "..."
            raise refuse(
                f"registry {self.registry} sent {subject} {shown} whose host URL parsers read differently "
                f"({_hostport(read)} to urlsplit, {_hostport(where)} to the HTTP client): refused, nothing "
                "was sent there"
            )
        if self._allows(where, prepared.url or ""):
            return where == self._own
        raise refuse(
            f"registry {self.registry} points {its} at {where[0]}://{where[1]}:{where[2]}, which is neither "
            f"the registry's own host nor a trusted {service}: refused, nothing was sent there (trust it "
            f"with the token_services setting if it is the registry's real {service})"
        )

    def check_realm(
        self,
        realm: str,
        *,
        params: Sequence[tuple[str, str]] | None = None,
        auth: tuple[str, str] | None = None,
    ) -> requests.PreparedRequest:
        """The token request to ``realm``, prepared, once it may be sent: refused when the realm is outside
        the registry's own host and the trusted token services, or when URL parsers read its host differently.

        :raises RealmRefused: naming the registry and the realm; nothing was sent.
        """
        try:
            prepared = self._session.prepare_request(
                requests.Request("GET", realm, params=params or [], auth=auth)
            )
        except (requests.RequestException, ValueError):
            raise RealmRefused(
                f"registry {self.registry} sent a Bearer realm that is not an http(s) URL: refused"
            ) from None
        self._vet(realm, prepared, "realm")
        return prepared

    def _send(self, prepared: requests.PreparedRequest) -> requests.Response:
        """Send exactly ``prepared``, never following a redirect; proxies and CA bundles from the environment
        apply as in ``Session.request``."""
        assert prepared.url is not None  # prepare_request always sets it (or raises)
        settings = self._session.merge_environment_settings(prepared.url, {}, None, None, None)
        return self._session.send(prepared, allow_redirects=False, timeout=self.timeout, **settings)

    def _redirect_url(self, response: requests.Response) -> str:
        """Where a redirect points, resolved against the URL that answered (as requests would)."""
        return urljoin(response.url, self._session.get_redirect_target(response) or "")

    def _exchange(
        self,
        method: str,
        url: str,
        *,
        scopes: tuple[str, ...],
        data: bytes | Path | None,
        headers: Mapping[str, str] | None,
        params: Mapping[str, str] | None,
        refresh: bool,
        follow: bool,
        target: str,
        location: bool,
    ) -> tuple[requests.Response, bool]:
        """Send one request and the redirects that may be followed; returns the last answer and whether it
        came from the registry's own host. Each hop is prepared, checked (:meth:`_vet`), sent as prepared."""
        kind = "location" if location else ""
        hops = 0
        while True:
            with ExitStack() as stack:
                body = stack.enter_context(data.open("rb")) if isinstance(data, Path) else data
                request = requests.Request(method, url, data=body, headers=dict(headers or {}), params=params)
                try:
                    prepared = self._session.prepare_request(request)
                except (requests.RequestException, ValueError):
                    if not kind:
                        raise
                    raise TargetRefused(
                        f"registry {self.registry} sent {_subject(kind, target)[0]} that is not an http(s) "
                        "URL: refused"
                    ) from None
                own = self._vet(url, prepared, kind, target) if kind else self._check_own(prepared)
                if own:  # our credentials go to the registry's own host only
                    prepared.headers.update(self._auth_header(scopes, refresh))
                try:
                    response = self._send(prepared)
                except requests.exceptions.SSLError as exc:
                    raise RegistryUnreachable(
                        f"TLS connection to registry {self.base_url} failed ({exc}); for a plain-HTTP "
                        "registry set insecure, for a private CA set ca_bundle on the registry connection"
                    ) from exc
                except requests.RequestException as exc:
                    if own:
                        raise RegistryUnreachable(f"registry {self.base_url} is unreachable: {exc}") from exc
                    raise RegistryUnreachable(
                        f"{shown_url(prepared.url or url)}, where registry {self.registry} sent {target}, is "
                        f"unreachable: {exc}"
                    ) from exc
            self._count(method, data, response)
            if not response.is_redirect:
                return response, own
            next_url = self._redirect_url(response)
            if not follow:
                raise TargetRefused(
                    f"registry {self.registry} redirected {target} (HTTP {response.status_code}) to "
                    f"{shown_url(next_url)}: refused, nothing was sent there (the distribution API redirects "
                    "only blob downloads)"
                )
            if hops == MAX_REDIRECTS:
                raise TargetRefused(
                    f"registry {self.registry} redirected {target} more than {MAX_REDIRECTS} times (last to "
                    f"{shown_url(next_url)}): refused"
                )
            hops += 1
            url, data, params, kind = next_url, None, None, "redirect"

    def _check_own(self, prepared: requests.PreparedRequest) -> bool:
        """A URL this client made from the registry's name and checked names: on the registry's own host."""
        if endpoint(prepared.url or "") != self._own:  # not reachable with checked names; kept as a guard
            raise TargetRefused(
                f"registry {self.registry}: {shown_url(prepared.url or '')} is not on its host"
            )
        return True

    def _count(self, method: str, data: bytes | Path | None, response: requests.Response) -> None:
        self.stats.requests += 1
        self.stats.by_method[method] = self.stats.by_method.get(method, 0) + 1
        if isinstance(data, bytes):
            self.stats.bytes_sent += len(data)
        elif isinstance(data, Path):
            self.stats.bytes_sent += data.stat().st_size
        if method != "HEAD":
            self.stats.bytes_received += len(response.content)
