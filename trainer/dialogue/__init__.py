"""Dialogue Transformer trainer: ``python -m trainer.dialogue``.

``trainer.dialogue.data`` (pair readers) and ``trainer.dialogue.tokenizer`` load without
TensorFlow; ``trainer.dialogue.model``, ``trainer.dialogue.serving`` (the SavedModel's ``generate``
signature) and ``trainer.dialogue.train`` import it.
"""
