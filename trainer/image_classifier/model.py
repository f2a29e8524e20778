"""The classifier network, its per-batch sums for the training loop, and the confusion matrix."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trainer.common.contract import UsageError

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

    from trainer.image_classifier.config import ClassifierConfig

log = logging.getLogger("kubetrain.trainer")


# Keras's default batch-norm momentum, 0.99, averages the moving statistics over about 100
# steps. That suits an epoch of hundreds of steps. On small data (the digits demo: 11 steps an
# epoch at batch size 128) the statistics that validation and the exported model use still
# describe the first, random weights after several epochs: at momentum 0.9 a trial reached a
# training accuracy of 0.93 at epoch 2 while its val_accuracy was 0.30 (0.95 at the momentum
# below), which misleads the best-epoch choice, --patience and a sweep's median stopping.
BN_WINDOW_EPOCHS = 0.25
BN_MOMENTUM_RANGE = (0.5, 0.99)


def batch_norm_momentum(steps_per_epoch: int) -> float:
    """A momentum whose moving average spans about a quarter of an epoch, within 0.5 and 0.99."""
    window = max(1.0, BN_WINDOW_EPOCHS * steps_per_epoch)  # steps; momentum m averages over 1 / (1 - m)
    low, high = BN_MOMENTUM_RANGE
    return round(min(high, max(low, 1.0 - 1.0 / window)), 4)


def build_model(
    config: ClassifierConfig, num_classes: int, steps_per_epoch: int | None = None
) -> keras.Model:
    """The classifier: pixel values 0-255 in, class probabilities out.

    ``steps_per_epoch`` sets the momentum of the batch-norm layers that train from random
    weights (:func:`batch_norm_momentum`); without it they keep Keras's defaults. Built under
    a strategy of several replicas, every batch-norm layer is synchronized: its batch
    statistics are those of the global batch, as with one device, not of each replica's share.
    """
    import keras
    import tensorflow as tf

    synchronized = tf.distribute.get_strategy().num_replicas_in_sync > 1

    # Only layers that start from random weights (the CNN never loads any): loaded statistics stay.
    momentum = batch_norm_momentum(steps_per_epoch) if steps_per_epoch and not config.weights else None

    size, channels = config.image_size, config.channels
    inputs = keras.Input((size, size, channels), name="image")
    if config.model == "cnn":
        x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
        for block in range(3):
            x = keras.layers.Conv2D(config.filters * 2**block, 3, padding="same", use_bias=False)(x)
            # 0.99: Keras's default
            x = keras.layers.BatchNormalization(momentum=momentum or 0.99, synchronized=synchronized)(x)
            x = keras.layers.ReLU()(x)
            x = keras.layers.MaxPooling2D()(x) if block < 2 else keras.layers.GlobalAveragePooling2D()(x)
    else:
        x = keras.layers.Rescaling(1.0 / 127.5, offset=-1.0)(inputs)  # MobileNetV2 expects [-1, 1]
        if config.weights:
            log.info("MobileNetV2 starts from the local weights file %s", config.weights)
        else:
            log.info(
                "no --weights given: MobileNetV2 starts from random weights (weights are never downloaded)"
            )
        try:
            base = keras.applications.MobileNetV2(
                input_shape=(size, size, 3),
                include_top=False,
                weights=config.weights,
                alpha=config.alpha,
                pooling="avg",
            )
        except (ValueError, OSError) as exc:
            raise UsageError(
                f"--weights {config.weights!r} cannot be loaded into MobileNetV2 "
                f"(alpha {config.alpha}, include_top=False): {exc}"
            ) from exc
        frozen = bool(config.weights) and config.freeze_base
        base.trainable = not frozen
        for layer in base.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = synchronized  # read at call time: the base is not called yet
                if momentum:  # MobileNetV2's own momentum, 0.999, is for its loaded statistics
                    layer.momentum = momentum
        # A frozen base runs its batch-norm layers in inference mode, keeping the loaded statistics.
        x = base(x, training=False) if frozen else base(x)
    x = keras.layers.Dropout(config.dropout, seed=config.seed)(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="probabilities")(x)
    if synchronized:
        log.info(
            "batch norm synchronized over the %d replicas: statistics of the global batch",
            tf.distribute.get_strategy().num_replicas_in_sync,
        )
    if momentum:
        log.info(
            "batch norm momentum %.4g: moving statistics over about %.0f%% of an epoch's %d steps",
            momentum,
            100 * BN_WINDOW_EPOCHS,
            steps_per_epoch,
        )
    return keras.Model(inputs, outputs, name=f"{config.model}_classifier")


def classification_sums(model: keras.Model, batch: Any, training: bool) -> dict[str, tf.Tensor]:
    """Per-replica loss and accuracy sums for a batch of (uint8 images, labels) or, with --augment, of
    (uint8 images, labels, augmentation draws): the augmentation runs here, in the step, on its device."""
    import keras
    import tensorflow as tf

    from trainer.image_classifier.data import model_pixels

    images, labels = batch[0], batch[1]
    probs = model(model_pixels(images, batch[2] if len(batch) > 2 else None), training=training)
    losses = keras.losses.sparse_categorical_crossentropy(labels, probs)
    predicted = tf.argmax(probs, axis=-1, output_type=labels.dtype)
    n = tf.cast(tf.shape(labels)[0], tf.float32)
    return {
        "loss_sum": tf.reduce_sum(tf.cast(losses, tf.float32)),
        "examples": n,
        "correct": tf.reduce_sum(tf.cast(tf.equal(predicted, labels), tf.float32)),
        "count": n,
    }


def confusion_matrix(model: keras.Model, dataset: tf.data.Dataset, num_classes: int) -> list[list[int]]:
    """Counts of (true class, predicted class) over ``dataset``."""
    import numpy as np
    import tensorflow as tf

    predict = tf.function(
        lambda x: tf.argmax(model(tf.cast(x, tf.float32), training=False), axis=-1, output_type=tf.int32)
    )
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    for images, labels in dataset:
        np.add.at(matrix, (labels.numpy(), predict(images).numpy()), 1)
    return matrix.tolist()
