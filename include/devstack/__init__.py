"""The embedded dev stack: S3, a container registry and a local Kubernetes API, all on loopback.

``python -m include.devstack up`` starts the three servers in the background and writes
``.stack/env`` (``export`` lines a shell can source) and ``.stack/kubeconfig``;
``python -m include.devstack down`` stops them. See README.md, "The dev stack".

This package uses only the standard library at import time so that both Python
environments (the Airflow one and the trainer one) can start and stop the stack.
"""
