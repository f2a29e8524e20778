"""The classifier SavedModel's signatures: images in, class names and probabilities out.

Both signatures do in the graph what training did to a file before the model saw it, with
the same functions (``tf.io.decode_image`` as the prepared copy decodes, then
:func:`trainer.image_classifier.data.resize_image`), so a served image cannot be prepared
differently from a training one:

* ``serve`` (also ``serving_default``): ``images``, a batch of encoded files (JPEG, PNG, GIF,
  BMP or WebP bytes), each of its own size;
* ``serve_pixels``: ``pixels``, uint8 ``[batch, height, width, channels]`` of any height and
  width (the channels the model was trained with).

Each returns ``class_name`` (string ``[batch]``, the most probable class), ``probability``
(float ``[batch]``, its probability), ``probabilities`` (float ``[batch, classes]``) and
``class_names`` (string ``[batch, classes]``, the names of those columns).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from trainer.image_classifier.data import resize_image


def decode_image(encoded: tf.Tensor, channels: int) -> tf.Tensor:
    """uint8 ``[h, w, channels]`` pixels of one encoded file, decoded as the prepared copy decodes it."""
    image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
    image.set_shape([None, None, channels])
    return image


class ImageServing(tf.Module):
    """The preprocessing and the class names of a trained classifier, as graph functions.

    Args:
        model: the classifier (uint8-range pixels ``[batch, size, size, channels]`` in,
            probabilities out).
        class_names: the class of each output column.
        image_size: the side the model was trained at.
        channels: the channels it was trained with.
    """

    def __init__(
        self, model: keras.Model, class_names: Sequence[str], image_size: int, channels: int
    ) -> None:
        super().__init__(name="image_serving")
        self.model = model
        self.image_size, self.channels = image_size, channels
        self.class_names = tf.constant(list(class_names))

    def classify(self, images: tf.Tensor) -> dict[str, tf.Tensor]:
        """Named outputs for resized uint8 images ``[batch, size, size, channels]``."""
        probabilities = tf.cast(self.model(tf.cast(images, tf.float32), training=False), tf.float32)
        best = tf.argmax(probabilities, axis=-1, output_type=tf.int32)
        batch = tf.shape(probabilities)[0]
        return {
            "class_name": tf.gather(self.class_names, best),
            "probability": tf.reduce_max(probabilities, axis=-1),
            "probabilities": probabilities,
            "class_names": tf.tile(self.class_names[None, :], [batch, 1]),
        }

    def serve_encoded(self, images: tf.Tensor) -> dict[str, tf.Tensor]:
        """Encoded files ``[batch]`` -> named outputs."""
        pixels = tf.map_fn(
            lambda encoded: resize_image(decode_image(encoded, self.channels), self.image_size),
            images,
            fn_output_signature=tf.TensorSpec([self.image_size, self.image_size, self.channels], tf.uint8),
        )
        return self.classify(pixels)

    def serve_pixels(self, pixels: tf.Tensor) -> dict[str, tf.Tensor]:
        """uint8 pixels ``[batch, h, w, channels]`` of any size -> named outputs."""
        return self.classify(resize_image(pixels, self.image_size))


def add_image_endpoints(
    archive: keras.export.ExportArchive,
    model: keras.Model,
    class_names: Sequence[str],
    image_size: int,
    channels: int,
) -> None:
    """Register ``serve`` (encoded files) and ``serve_pixels`` (uint8 pixels) on ``archive``."""
    serving = ImageServing(model, class_names, image_size, channels)
    archive.track(serving)
    archive.add_endpoint(
        "serve", serving.serve_encoded, input_signature=[tf.TensorSpec([None], tf.string, name="images")]
    )
    archive.add_endpoint(
        "serve_pixels",
        serving.serve_pixels,
        input_signature=[tf.TensorSpec([None, None, None, channels], tf.uint8, name="pixels")],
    )
