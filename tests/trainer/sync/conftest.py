"""Fixtures of the transfer tool's tests.

``s3_server`` (tests/conftest.py) is the dev stack's S3 server, which verifies every SigV4
signature. ``moto_server`` (tests/conftest.py) is moto's S3 server, for the verification paths
that need what the dev stack's server does not do (include/devstack/S3.md): multipart ETags of
the form ``<md5>-<parts>``, ``If-Match``, and the checksums a store keeps (``x-amz-checksum-*``).
"""
