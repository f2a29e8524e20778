"""Pieces shared by the trainers: the pod contract, typed configuration, signals and the
training loop with checkpoint/resume.

``config``, ``contract``, ``metrics_doc``, ``stopping`` and ``signals`` import neither TensorFlow nor Keras
(the flags and the data are checked before TensorFlow loads); ``runtime``, ``loop``, ``steps``,
``summaries``, ``export``, ``checkpoints``, ``best_epoch``, ``replicas``, ``progress`` and ``nan_guard`` do.
"""
