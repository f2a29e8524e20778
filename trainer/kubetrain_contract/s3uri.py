"""``s3://bucket/key`` addresses as both sides read them: one parser, one set of checks.

The Airflow side reads them from Params, settings and records; the pod side from its
``KUBETRAIN_*_URI`` variables and flags. Both refuse the same values with the same sentence.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

SCHEME = "s3://"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def check_bucket(bucket: str) -> str:
    """Return ``bucket`` when it is a valid S3 bucket name, else raise ``ValueError``."""
    if not isinstance(bucket, str) or not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(
            f"bucket name {bucket!r} is not valid: expected 3-63 characters of a-z, 0-9, '.' and '-'"
        )
    return bucket


@dataclass(frozen=True)
class S3Uri:
    """An ``s3://bucket/key`` address; unpacks as ``bucket, key = uri``."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def __iter__(self) -> Iterator[str]:
        return iter((self.bucket, self.key))

    def join(self, *parts: str) -> S3Uri:
        """Return the URI of ``parts`` below this one, separated by slashes."""
        key = (
            "/".join([self.key.rstrip("/"), *(p.strip("/") for p in parts)]) if self.key else "/".join(parts)
        )
        return S3Uri(self.bucket, key)


def parse_s3_uri(uri: str, what: str = "S3 URI") -> S3Uri:
    """Parse ``s3://bucket/key``; the key may be empty (a bucket, or a prefix).

    :param uri: the text to parse.
    :param what: how the error message names the value (a flag, a variable, a Param).
    :raises ValueError: ``uri`` is not a string of the form ``s3://<bucket>[/<key>]``, or its
        bucket is not a valid bucket name; the message names ``what`` and ``uri``.
    """
    if not isinstance(uri, str) or not uri.startswith(SCHEME):
        raise ValueError(f"{what} {uri!r} is not an S3 URI: expected s3://<bucket>/<key or prefix>")
    bucket, _, key = uri[len(SCHEME) :].partition("/")
    try:
        check_bucket(bucket)
    except ValueError as exc:
        raise ValueError(f"{what} {uri!r}: {exc}") from None
    return S3Uri(bucket, key)
