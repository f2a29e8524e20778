"""Hyperparameter sweeps: grid, random and Bayesian (TPE) search over mapped training pods.

The sweep DAGs are built by :func:`~kubetrain.sweep.pipeline.sweep_pipeline` (public: ``from
kubetrain import sweep_pipeline``, beside ``training_pipeline``) with a DAG's fixed
:class:`~kubetrain.sweep.config.SweepSettings`. Importing this package is cheap: Optuna,
boto3 and matplotlib are imported only when a task runs.
"""
