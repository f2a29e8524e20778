"""Image classifier trainer: ``python -m trainer.image_classifier``.

``trainer.image_classifier.config`` (flags) and ``trainer.image_classifier.data`` (the
folder scan and split) load without TensorFlow; the input pipeline, ``model`` and
``train`` import it when they run.
"""
