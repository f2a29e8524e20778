"""A small Keras image classifier, as a data engineer might have it: no S3, no Airflow.

It follows kubetrain's pod contract (docs/extending.md): it reads images in class folders from
$DATA_DIR, keeps Keras' backup in $CHECKPOINT_DIR (a retried pod resumes from it), and writes
the model, metrics.json and history.csv to $OUTPUT_DIR for the report and the promotion.

    python train.py --epochs 3 --learning-rate 0.001
"""

import argparse
import csv
import json
import os
from pathlib import Path

import keras

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--learning-rate", type=float, default=0.001)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--image-size", type=int, default=16)
args = parser.parse_args()

data, checkpoints, output = (Path(os.environ[name]) for name in ("DATA_DIR", "CHECKPOINT_DIR", "OUTPUT_DIR"))
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
history = model.fit(
    train,
    validation_data=val,
    epochs=args.epochs,
    verbose=2,
    callbacks=[keras.callbacks.BackupAndRestore(str(checkpoints / "backup"))],  # resume after a killed pod
).history

model.save(output / "model.keras")
rows = [{"epoch": i + 1, **{k: v[i] for k, v in history.items()}} for i in range(len(history["loss"]))]
with open(output / "history.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
final = {k: float(v) for k, v in rows[-1].items() if k != "epoch"}
(output / "metrics.json").write_text(
    json.dumps(
        {
            "trainer": "keras_model",
            "task": "classification",
            "monitor": "val_accuracy",
            "monitor_mode": "max",
            "final": final,
            "epochs": args.epochs,
            "classes": classes,
        }
    )
)
print(f"trained {args.epochs} epochs: val_accuracy {final['val_accuracy']:.3f}", flush=True)
