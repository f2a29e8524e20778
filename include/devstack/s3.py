"""The dev stack's S3 server: moto in server mode, with the project's buckets created.

Run from the Airflow environment: ``python -m include.devstack.s3 --port 9000``.
The embedded server keeps objects in memory and accepts any credentials; the stack
still generates a key pair and hands it out only through .stack/env and the
``kubetrain-s3`` Secret, so code and pod specs are written as they would be for MinIO.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading

REPORT_POLICY = {
    "Version": "2012-10-17",
    "Statement": [
        {
            "Sid": "ReadReports",
            "Effect": "Allow",
            "Principal": "*",
            "Action": "s3:GetObject",
            "Resource": "arn:aws:s3:::training/runs/*/report/*",
        }
    ],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m include.devstack.s3", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--buckets", nargs="*", default=["datasets", "training"])
    args = parser.parse_args(argv)

    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=args.host, port=args.port, verbose=False)
    server.start()
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://{args.host}:{args.port}",
        aws_access_key_id=os.environ.get("KUBETRAIN_S3_ACCESS_KEY_ID", "dev"),
        aws_secret_access_key=os.environ.get("KUBETRAIN_S3_SECRET_ACCESS_KEY", "dev"),
        region_name="us-east-1",
    )
    for bucket in args.buckets:
        s3.create_bucket(Bucket=bucket)
    if "training" in args.buckets:
        # Reports open in a browser straight from the embedded S3 (the report link of the
        # Airflow UI); nothing else in the buckets is readable without credentials.
        s3.put_bucket_policy(Bucket="training", Policy=json.dumps(REPORT_POLICY))
    print(f"S3 on http://{args.host}:{args.port} with buckets {', '.join(args.buckets)}", flush=True)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
