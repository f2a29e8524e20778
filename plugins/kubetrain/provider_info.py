"""kubetrain as an Airflow provider: what the ``apache_airflow_provider`` entry point returns.

Installed as a distribution (``pip install .``), kubetrain is listed by ``airflow providers
list`` like any provider; its registry connection type (``kubetrain_registry``, with its form
fields) appears in the UI's connection form, and the "Training report" link is known to the
API server. The dictionary follows Airflow's ``provider_info.schema.json``. The connection
form is declared the way Airflow 3 reads it without importing the hook or a form library
(``conn-fields`` for the connection's extras, ``ui-field-behaviour`` for its standard fields),
from the extras and field behaviour that :class:`~kubetrain.hooks.registry.RegistryHook` defines.
"""

from __future__ import annotations

from typing import Any

from kubetrain import __version__

PACKAGE_NAME = "kubetrain"


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
    from kubetrain.hooks.registry import RegistryHook

    behaviour = RegistryHook.get_ui_field_behaviour()
    return {
        "hidden-fields": behaviour.get("hidden_fields", []),
        "relabeling": behaviour.get("relabeling", {}),
        "placeholders": {k: v for k, v in behaviour.get("placeholders", {}).items() if k != "extra"},
    }


def get_provider_info() -> dict[str, Any]:
    """The provider's description, connection types, extra links and plugin."""
    from kubetrain.hooks.registry import RegistryHook

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
                "hook-class-name": f"{RegistryHook.__module__}.{RegistryHook.__qualname__}",
                "hook-name": RegistryHook.hook_name,
                "connection-type": RegistryHook.conn_type,
                "conn-fields": REGISTRY_CONN_FIELDS,
                "ui-field-behaviour": _field_behaviour(),
            }
        ],
        "extra-links": ["kubetrain.links.ReportLink"],
        "plugins": [{"name": "kubetrain", "plugin-class": "kubetrain_plugin.KubetrainPlugin"}],
    }
