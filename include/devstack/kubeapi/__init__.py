"""A local Kubernetes API server that runs pod containers as local processes.

``python -m include.devstack.kubeapi --host 127.0.0.1 --port PORT --state-dir DIR`` serves
enough of the Kubernetes REST protocol (core/v1 pods, logs, exec, attach, events, secrets,
configmaps, namespaces, nodes, headless services; batch/v1 jobs; watches; discovery, with no
custom resources; OpenAPI v3 for kubectl; JSON, YAML and protobuf bodies) for the official
Python clients, kubectl and the cncf-kubernetes provider's operators.

Each container runs as a local process in its own mount and PID namespace, with the
pod's volumes bind-mounted at their mount paths and an address of its own on loopback;
see include/devstack/KUBEAPI.md.

This ``__init__`` imports nothing: the package needs aiohttp (Airflow environment) only
when the server itself starts.
"""
