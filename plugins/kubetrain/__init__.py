"""kubetrain's Airflow side: operators, hooks, pod-spec building, S3 run layout and reports.

The names in ``__all__`` are kubetrain's public API: a DAG may import them from here
(``from kubetrain import TrainingPodOperator``) or from the module that defines them, and they
keep their names and arguments within a major version (a renamed one stays importable, with a
deprecation warning, for one release). Everything else in the package (pod_spec, pod_startup,
run_store, s3_layout, images, imagebuild, preflight, store, triggers, api, links, report, settings'
internals) is internal and may change in any release: the shipped DAGs import only the names below. docs/extending.md shows the public API at work.

Importing this package is cheap (no boto3, TensorFlow or network, and no provider): the names
below are imported on first use. It registers the trigger form's dataset URI format with
jsonschema (:mod:`kubetrain.params`).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from kubetrain import params as _params  # noqa: F401  registers the S3 URI format of the trigger form

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    # the shared training pipeline and its Params
    "training_pipeline": "kubetrain.pipeline",
    "common_params": "kubetrain.pipeline",
    "schedule": "kubetrain.pipeline",
    "TrainingTasks": "kubetrain.pipeline",
    "CPU_PATTERN": "kubetrain.pipeline",
    "MEMORY_PATTERN": "kubetrain.pipeline",
    "DEFAULT_ARGS": "kubetrain.defaults",
    "environ": "kubetrain.settings",
    # the built-in trainers, each described once (its flags are kubetrain_contract.flags')
    "TrainerSpec": "kubetrain.trainers",
    "IMAGE_CLASSIFIER": "kubetrain.trainers",
    "DIALOGUE_TRANSFORMER": "kubetrain.trainers",
    # hyperparameter sweeps
    "sweep_pipeline": "kubetrain.sweep.pipeline",
    "SweepTasks": "kubetrain.sweep.pipeline",
    "SweepSettings": "kubetrain.sweep.config",
    "tunable_schemas": "kubetrain.sweep.space",
    # datasets
    "dataset_asset": "kubetrain.operators.stage",
    "dataset_name_from_uri": "kubetrain.manifest",
    "form_order": "kubetrain.params",
    "with_dialect": "kubetrain.params",
    "S3_URI": "kubetrain.params",
    # operators
    "TrainingPodOperator": "kubetrain.operators.training",
    "StageDatasetOperator": "kubetrain.operators.stage",
    "SkipIfTrainedOperator": "kubetrain.operators.dedupe",
    "RecordTrainingOperator": "kubetrain.operators.dedupe",
    "ReportOperator": "kubetrain.operators.report",
    "PromoteModelOperator": "kubetrain.operators.promote",
    "BuildImageOperator": "kubetrain.operators.build",
    "AppendLayerOperator": "kubetrain.operators.build",
    "DistributedTrainingOperator": "kubetrain.operators.distributed",
    "TriggererAccessOperator": "kubetrain.operators.preflight",
    # hooks and links
    "RegistryHook": "kubetrain.hooks.registry",
    "ReportLink": "kubetrain.links",
    # what a training task fails with, by class
    "PodUnschedulableError": "kubetrain.pod_startup",
    "ImagePullError": "kubetrain.pod_startup",
    "PodStartupTimeout": "kubetrain.pod_startup",
    "StageInError": "kubetrain.pod_startup",
    # the task bodies of the shipped maintenance DAGs (build_trainer_image, kubetrain_preflight,
    # kubetrain_run_index), for a deployment that schedules them its own way
    "plan_images": "kubetrain.imagebuild.trainer_image",
    "image_build_tasks": "kubetrain.imagebuild.trainer_image",
    "publish_images": "kubetrain.imagebuild.trainer_image",
    "run_preflight": "kubetrain.preflight",
    "fail_on_failures": "kubetrain.preflight",
    "maintain_run_index": "kubetrain.store.rebuild_index",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kubetrain' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
