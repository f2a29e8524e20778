"""The pod-side S3 transfer tool: ``python -m trainer.sync stage-in|checkpoint-sync|restore``.

* ``stage-in`` (init container): download a staged dataset snapshot into ``DATA_DIR``,
  verify every object, extract archives safely, and restore this run's latest verified
  checkpoints into ``CHECKPOINT_DIR`` so that a retried pod resumes.
* ``checkpoint-sync`` (native sidecar): upload new or changed files from
  ``CHECKPOINT_DIR`` and ``OUTPUT_DIR`` every few seconds and commit each pass with a
  manifest; a final pass on SIGTERM.
* ``restore``: download the files of the newest verified pass manifest.

The formats it reads and writes are described in ``trainer/sync/README.md`` and, as JSON
Schemas, in ``trainer/sync/schemas/`` (the pod's environment) and ``kubetrain_contract/schemas/``
(the dataset and sync-pass manifests, generated from :mod:`kubetrain_contract.manifests`).
Besides the standard library the package needs awscrt (the AWS Common Runtime's S3 client:
object data, and every other call when keys are in the environment; CRC32C/CRC64NVME),
botocore (those other calls, and the credential chain, under workload identity) and
s3transfer (workload-identity credentials for the CRT), with their
dependencies, pinned in ``trainer/requirements-sync.txt``: what its small image
(``trainer/Dockerfile.sync``) installs, and nothing else.
"""

from __future__ import annotations
