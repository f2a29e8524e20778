"""kubetrain's pod side: the training programs and the S3 transfer tool.

Run the trainers as ``python -m trainer.image_classifier`` and ``python -m trainer.dialogue``.
This package must stay light to import: TensorFlow is imported only by the modules that
train, never here, so that the transfer tool starts quickly in its small image.
"""
