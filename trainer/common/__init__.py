"""Pieces shared by the trainers: the pod contract, typed configuration, signals and the
training loop with checkpoint/resume.

Only ``trainer.common.runtime`` and ``trainer.common.loop`` import TensorFlow.
"""
