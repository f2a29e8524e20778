"""A small Keras image classifier, as a data engineer might have it: no S3, no Airflow.

It follows kubetrain's pod contract (docs/extending.md): it reads images in class folders from
$DATA_DIR and writes the model to $OUTPUT_DIR. The kit's Keras callback (kubetrain_contract, a
standard-library wheel: `make kit`) does the rest: a report every epoch (metrics.jsonl, which a
sweep's early-stopping rules read), checkpoints in $CHECKPOINT_DIR, a preempted pod that saves at
the next batch and resumes there, the stop file, and metrics.json and history.csv at the end.

    python train.py --epochs 3 --learning-rate 0.001
"""

import argparse
import os
from pathlib import Path

import keras

from kubetrain_contract.keras_callback import KubetrainCallback

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--learning-rate", type=float, default=0.001)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--image-size", type=int, default=16)
args = parser.parse_args()

data, output = Path(os.environ["DATA_DIR"]), Path(os.environ["OUTPUT_DIR"])
while len(entries := list(data.iterdir())) == 1 and entries[0].is_dir():  # an archive's top-level folder
    data = entries[0]
size = (args.image_size, args.image_size)
train, val = keras.utils.image_dataset_from_directory(
    data,
    validation_split=0.2,
    subset="both",
    seed=42,
    image_size=size,
    color_mode="grayscale",
    batch_size=args.batch_size,
)
classes = train.class_names

model = keras.Sequential(
    [
        keras.Input((*size, 1)),
        keras.layers.Rescaling(1 / 255),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(len(classes), activation="softmax"),
    ]
)
model.compile(
    keras.optimizers.Adam(args.learning_rate), "sparse_categorical_crossentropy", metrics=["accuracy"]
)
details = {"task": "classification", "classes": classes}
kt = KubetrainCallback(monitor="val_accuracy", trainer="keras_model", details=details)
model.fit(kt.resumable(train, val), validation_data=val, epochs=args.epochs, verbose=2, callbacks=[kt])

model.save(output / "model.keras")
print(f"trained {len(kt.history)} epochs: val_accuracy {kt.history[-1]['val_accuracy']:.3f}", flush=True)
raise SystemExit(kt.exit_code)  # 79 when the stop file ended it early (a sweep's rule)
