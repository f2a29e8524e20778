"""The transfer tool's errors: what a pod log says when a command fails, and how a caller tells them apart.

``SyncError`` ends a command with exit status 1 and its message in the pod log; its subclasses
say whether retrying can help (``Refused``) and whether a restore should fall back to an older
pass (``NotAsListed``). The S3 answers' error documents are read here too.
"""

from __future__ import annotations

from kubetrain_contract import s3uri
from kubetrain_contract.s3uri import S3Uri


class SyncError(Exception):
    """A failure with a message meant for the pod log (exit status 1)."""


class Refused(SyncError):
    """A failure that retrying cannot mend: another object than the one asked for, a full disk."""


class NotAsListed(Refused):
    """The object is not the one a manifest lists: gone, another ETag, size or checksum.

    A restore that meets it falls back to an older pass; nothing else tells it apart by message.
    """


class ChecksumMismatch(NotAsListed):
    """The engine found the bytes it received do not give the checksum it was to check them against."""


class S3RequestError(SyncError):
    """An S3 request failed with an HTTP status (after the engine's retries)."""

    def __init__(self, uri: S3Uri, status: int, code: str, message: str = "") -> None:
        self.uri, self.status, self.code = uri, status, code
        super().__init__(f"{uri}: HTTP {status} {code}{': ' + message if message else ''}")


def error_code(body: bytes | None) -> tuple[str, str]:
    """The ``Code`` and ``Message`` of an S3 error document (empty strings when there is none)."""
    import xml.etree.ElementTree as ET  # here: only an error reads it, and a stage-in starts 3 ms sooner

    try:
        root = ET.fromstring(body or b"")
    except ET.ParseError:
        return "", ""
    return root.findtext("Code") or "", root.findtext("Message") or ""


def xml_text(body: bytes, name: str) -> str:
    """The text of the first element ``name`` (any namespace) of an S3 XML answer; empty if none."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(body or b"")
    except ET.ParseError:
        return ""
    for element in root.iter():
        if element.tag.rpartition("}")[2] == name:
            return element.text or ""
    return ""


def quoted_etag(etag: str) -> str:
    """An ETag in its quotes, as S3 lists it (some servers list it without)."""
    return '"' + etag.strip('"') + '"' if etag else ""


def client_error(uri: S3Uri, exc: Exception) -> SyncError:
    """A botocore exception as a ``SyncError`` naming the URI (``S3RequestError`` for an HTTP status)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        error = response.get("Error", {})
        status = int(meta.get("HTTPStatusCode") or 0)
        return S3RequestError(uri, status, error.get("Code", ""), error.get("Message", ""))
    return SyncError(f"{uri}: {exc}")


def parse_s3_uri(uri: str, what: str = "S3 URI") -> S3Uri:
    """The contract's :func:`kubetrain_contract.s3uri.parse_s3_uri`, its refusal a ``SyncError``.

    Args:
        uri: the text to parse.
        what: how the error message names the value (a flag or a ``KUBETRAIN_*`` variable).

    Raises:
        SyncError: ``uri`` is not of the form ``s3://<bucket>[/<key>]`` with a valid bucket name.
    """
    try:
        return s3uri.parse_s3_uri(uri, what)
    except ValueError as exc:
        raise SyncError(str(exc)) from None
