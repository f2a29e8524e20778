"""A user's Keras script with the kit's callback (tests/trainer/contract/test_keras_callback.py runs it).

Trains a small model on a seeded synthetic dataset; KIT_SIGTERM_AT_STEP sends this process SIGTERM after
that optimizer step (a preemption mid-epoch), KIT_STOP_AT_EPOCH writes the stop file after that epoch.
Prints one JSON line: the optimizer's steps, the batches trained in this process and the exit code.
"""

import json
import os
import signal

import keras
import numpy as np
import tensorflow as tf

from kubetrain_contract import kit
from kubetrain_contract.keras_callback import KubetrainCallback

keras.utils.set_random_seed(7)
rng = np.random.default_rng(0)
x = rng.normal(size=(240, 8)).astype("float32")
y = (x[:, :2].sum(axis=1) > 0).astype("int32")
train = tf.data.Dataset.from_tensor_slices((x[:192], y[:192])).batch(16)  # 12 batches an epoch
val = tf.data.Dataset.from_tensor_slices((x[192:], y[192:])).batch(16)

model = keras.Sequential(
    [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
)
model.compile(
    keras.optimizers.Adam(0.01),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
sigterm_at = int(os.environ.get("KIT_SIGTERM_AT_STEP", "0"))
stop_at = int(os.environ.get("KIT_STOP_AT_EPOCH", "0"))
trained = []


class Fault(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        trained.append(int(model.optimizer.iterations))
        if sigterm_at and int(model.optimizer.iterations) == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_epoch_end(self, epoch, logs=None):
        if stop_at and epoch + 1 == stop_at:
            kit.stop_file().touch()


kt = KubetrainCallback(monitor="val_accuracy", save_every_steps=int(os.environ.get("KIT_SAVE_EVERY", "5")))
try:
    model.fit(kt.resumable(train, val), validation_data=val, epochs=4, callbacks=[Fault(), kt], verbose=0)
    code = kt.exit_code
except SystemExit as exc:
    code = exc.code
print(
    json.dumps(
        {"steps": int(model.optimizer.iterations), "trained": trained, "code": code, "resumed": kt.resumed_at}
    )
)
raise SystemExit(code)
