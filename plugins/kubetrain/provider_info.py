"""kubetrain as an Airflow provider: what the ``apache_airflow_provider`` entry point returns.

Installed as a distribution (``pip install .``), kubetrain is listed by ``airflow providers
list`` like any provider; its registry connection type (``kubetrain_registry``, with its form
fields) appears in the UI's connection form, and the "Training report" link is known to the
API server. The dictionary follows Airflow's ``provider_info.schema.json``. The connection
form is declared the way Airflow 3 reads it without importing the hook or a form library
(``conn-fields`` for the connection's extras, ``ui-field-behaviour`` for its standard fields).

This module imports nothing of Airflow, and neither does :func:`get_provider_info`: Airflow calls
it while it is starting, which may be in the middle of importing
:mod:`kubetrain.hooks.registry` (``from kubetrain import RegistryHook`` in an interpreter that has
not imported Airflow yet), so importing the hook here would be a circular import. The registry
connection's type, name and form are therefore defined here, and
:class:`~kubetrain.hooks.registry.RegistryHook` takes them from here.
"""

from __future__ import annotations

import json
from typing import Any

from kubetrain import __version__

PACKAGE_NAME = "kubetrain"

# The registry connection type, as RegistryHook declares it (conn_type, hook_name).
REGISTRY_HOOK_CLASS = "kubetrain.hooks.registry.RegistryHook"
REGISTRY_CONN_TYPE = "kubetrain_registry"
REGISTRY_HOOK_NAME = "Container registry (kubetrain)"

# The standard fields of the registry connection's form, in the shape of a hook's get_ui_field_behaviour().
REGISTRY_FIELD_BEHAVIOUR: dict[str, Any] = {
    "hidden_fields": ["schema"],
    "relabeling": {
        "host": "Registry host",
        "login": "Username",
        "password": "Password or access token",
    },
    "placeholders": {
        "host": "registry.example.com",
        "port": "443",
        "extra": json.dumps({"insecure": False, "tls_verify": True, "ca_bundle": None, "token": None}),
    },
}


# The registry connection's extras (RegistryHook reads each from the connection's extra).
REGISTRY_CONN_FIELDS: dict[str, dict[str, Any]] = {
    "insecure": {
        "label": "Plain HTTP (insecure)",
        "schema": {"type": ["boolean", "null"]},
        "description": "Talk to the registry over HTTP: development registries on a trusted network only.",
    },
    "tls_verify": {
        "label": "Verify TLS certificates",
        "schema": {"type": ["boolean", "null"]},
        "description": "Default true.",
    },
    "ca_bundle": {
        "label": "CA bundle",
        "schema": {"type": ["string", "null"]},
        "description": "Path of a PEM file, for a registry with a private CA.",
    },
    "token": {
        "label": "Bearer token",
        "schema": {"type": ["string", "null"], "format": "password"},
        "description": "A ready token, instead of a username and password.",
    },
    "timeout": {
        "label": "Timeout (seconds)",
        "schema": {"type": ["number", "null"]},
        "description": "Per request; default 60.",
    },
}


def _field_behaviour() -> dict[str, Any]:
    behaviour = REGISTRY_FIELD_BEHAVIOUR
    return {
        "hidden-fields": behaviour.get("hidden_fields", []),
        "relabeling": behaviour.get("relabeling", {}),
        "placeholders": {k: v for k, v in behaviour.get("placeholders", {}).items() if k != "extra"},
    }


def get_provider_info() -> dict[str, Any]:
    """The provider's description, connection types, extra links and plugin (without importing any of them)."""
    return {
        "package-name": PACKAGE_NAME,
        "name": "kubetrain",
        "description": (
            "Train TensorFlow models on Kubernetes from Airflow: stage datasets from S3, run training pods "
            "that resume from their checkpoints, report, promote, and build training images."
        ),
        "versions": [__version__],
        "integrations": [{"integration-name": "kubetrain", "tags": ["software"]}],
        "operators": [
            {
                "integration-name": "kubetrain",
                "python-modules": [
                    "kubetrain.operators.training",
                    "kubetrain.operators.stage",
                    "kubetrain.operators.dedupe",
                    "kubetrain.operators.report",
                    "kubetrain.operators.promote",
                    "kubetrain.operators.build",
                ],
            }
        ],
        "hooks": [{"integration-name": "kubetrain", "python-modules": ["kubetrain.hooks.registry"]}],
        "triggers": [
            {
                "integration-name": "kubetrain",
                "python-modules": ["kubetrain.triggers.pod", "kubetrain.triggers.sync"],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": REGISTRY_HOOK_CLASS,
                "hook-name": REGISTRY_HOOK_NAME,
                "connection-type": REGISTRY_CONN_TYPE,
                "conn-fields": REGISTRY_CONN_FIELDS,
                "ui-field-behaviour": _field_behaviour(),
            }
        ],
        "extra-links": ["kubetrain.links.ReportLink"],
        "plugins": [{"name": "kubetrain", "plugin-class": "kubetrain_plugin.KubetrainPlugin"}],
    }
