"""``python -m trainer.sync probe``: what the preflight asks of S3 from inside a pod.

The preflight (plugins/kubetrain/preflight/s3.py) runs it in a pod of the sync image with the
training pods' credentials, so every answer comes from the clients, the environment and the
network path that stage-in and the checkpoint sidecar use:

* ``list``: list the datasets bucket (botocore, as the sidecar's calls);
* ``region``: the region of each bucket, asked of S3 (:meth:`S3.bucket_region`), against the
  region the pods are configured to sign for (``AWS_REGION``, ``AWS_DEFAULT_REGION``, else
  us-east-1);
* ``write``: put a small object under the scratch URI in the training bucket (botocore, as the
  sidecar uploads checkpoints), read it back through the CRT (the stage-in and restore
  download path) and compare the bytes, then delete it.

Each step prints one line, and the last line is ``KUBETRAIN_PROBE <json>``: for each step
``ok`` and ``detail`` (the error text when it failed), which the preflight turns into its
lines. A failed step does not stop the others; the exit status is 0 once the report is out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from kubetrain_contract.s3uri import S3Uri
from trainer.sync.progress import log
from trainer.sync.s3 import S3

REPORT_PREFIX = "KUBETRAIN_PROBE "
PAYLOAD_SIZE = 64 * 1024


def _step(name: str, report: dict, fn: Callable[[], dict]) -> None:
    try:
        result = {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 - every failure becomes the step's detail
        detail = f"{type(exc).__name__}: {exc}" if type(exc).__name__ not in str(exc) else str(exc)
        result = {"ok": False, "detail": " ".join(detail.split())[:500]}
    report[name] = result
    log(f"probe {name}: {'ok' if result['ok'] else 'FAILED'}: {result.get('detail', '')}".rstrip(": "))


def probe(s3: S3, datasets_bucket: str, scratch: S3Uri) -> dict:
    """Run every step; the report that is printed after ``KUBETRAIN_PROBE``."""
    report: dict = {}

    def listing() -> dict:
        page = s3.client.list_objects_v2(Bucket=datasets_bucket, MaxKeys=1)
        return {
            "detail": f"listed {datasets_bucket} ({page.get('KeyCount', 0)} object(s) in the first page) "
            f"from {s3.client.meta.endpoint_url}"
        }

    def regions() -> dict:
        found = {b: s3.bucket_region(b) for b in dict.fromkeys((datasets_bucket, scratch.bucket))}
        return {
            "configured": s3.region,
            "buckets": found,
            "detail": ", ".join(f"{b} in {r}" for b, r in found.items()) + f"; pods sign for {s3.region}",
        }

    def write_read_delete() -> dict:
        payload = os.urandom(PAYLOAD_SIZE)
        s3.client.put_object(Bucket=scratch.bucket, Key=scratch.key, Body=payload)
        try:
            got = bytearray(len(payload))
            seen = {"bytes": 0}

            def on_body(chunk: memoryview, offset: int) -> None:
                got[offset : offset + len(chunk)] = chunk
                seen["bytes"] += len(chunk)

            s3.get_object(scratch.bucket, scratch.key, on_body=on_body).wait()
            if seen["bytes"] != len(payload) or bytes(got) != payload:
                raise ValueError(
                    f"{scratch} came back different through the CRT ({seen['bytes']} of {len(payload)} bytes)"
                )
        finally:
            s3.client.delete_object(Bucket=scratch.bucket, Key=scratch.key)
        return {"detail": f"wrote, read back through the CRT and deleted {len(payload)} bytes at {scratch}"}

    _step("list", report, listing)
    _step("region", report, regions)
    _step("write", report, write_read_delete)
    print(REPORT_PREFIX + json.dumps(report, sort_keys=True), flush=True)
    return report
