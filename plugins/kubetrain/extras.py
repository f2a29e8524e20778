"""The optional parts of kubetrain and the extra that installs each (``pip install 'kubetrain[tpe]'``).

pyproject.toml declares them; a feature whose extra is missing fails with this module's message,
which names the extra, instead of a bare ``ModuleNotFoundError`` from deep inside a task.
"""

from __future__ import annotations

EXTRAS = {
    "tpe": ("optuna", "`algorithm: tpe` sweeps"),
    "trainjob": ("kubeflow-trainer-api", "the trainjob backend (Kubeflow Trainer v2)"),
}


def missing_extra(extra: str, error: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error to raise when ``error`` says that ``extra``'s distribution is not installed."""
    distribution, feature = EXTRAS[extra]
    return ModuleNotFoundError(
        f"{feature} need the {distribution} distribution, which is not installed ({error}): install kubetrain "
        f"with the {extra!r} extra, e.g. pip install 'kubetrain[{extra}]' (the Airflow image installs kubetrain[all])",
        name=error.name,
    )
