"""Dialogue Transformer trainer: ``python -m trainer.dialogue``.

``trainer.dialogue.data`` (pair readers) and ``trainer.dialogue.tokenizer`` load without
TensorFlow; ``trainer.dialogue.model`` and ``trainer.dialogue.train`` import it.
"""
