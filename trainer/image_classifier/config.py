"""Flags of the image classifier."""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainer.common.config import TrainerConfig, option, require

MOBILENET_ALPHAS = (0.35, 0.5, 0.75, 1.0, 1.3, 1.4)


@dataclass
class ClassifierConfig(TrainerConfig):
    """Flags of the image classifier."""

    batch_size: int = option(32, "global batch size, split evenly over the devices")
    learning_rate: float = option(1e-3, "Adam learning rate")
    model: str = option("cnn", "network: a small CNN or MobileNetV2", choices=("cnn", "mobilenet_v2"))
    image_size: int = option(64, "images are resized to SIZE x SIZE pixels", metavar="SIZE")
    channels: int = option(3, "colour channels the images are decoded to", choices=(1, 3))
    filters: int = option(32, "filters of the CNN's first block (doubled in each of the next two)")
    alpha: float = option(1.0, "MobileNetV2 width multiplier", choices=MOBILENET_ALPHAS)
    weights: str | None = option(
        None,
        "local MobileNetV2 weights file (.weights.h5 or .h5, without the top); never downloaded",
        metavar="PATH",
    )
    freeze_base: bool = option(True, "keep MobileNetV2's loaded weights frozen (only with --weights)")
    dropout: float = option(0.2, "dropout before the classification layer")
    augment: bool = option(False, "random shifts, brightness and contrast on training images")
    flip: bool = option(False, "random left-right flips on training images (not for digits or text)")
    cache: bool = option(True, "keep decoded images in memory after the first epoch")
    shuffle_buffer: int = option(
        0,
        "images in the shuffle buffer of the cached training split (0: all of them, an exact shuffle; the "
        "buffer refers to the cached images, it does not copy them). Without --cache every epoch reads the files "
        "in a new seeded order instead",
        metavar="N",
    )
    verify_workers: int = option(8, "threads that check the image files before training")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.learning_rate > 0, "learning_rate", self.learning_rate, "a number > 0")
        require(
            isinstance(self.image_size, int) and 8 <= self.image_size <= 1024,
            "image_size",
            self.image_size,
            "an integer from 8 to 1024",
        )
        require(
            isinstance(self.filters, int) and 1 <= self.filters <= 1024,
            "filters",
            self.filters,
            "an integer from 1 to 1024",
        )
        require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a fraction in [0, 1)")
        require(
            isinstance(self.shuffle_buffer, int) and self.shuffle_buffer >= 0,
            "shuffle_buffer",
            self.shuffle_buffer,
            "an integer >= 0 (0: the whole training split)",
        )
        require(
            isinstance(self.verify_workers, int) and 1 <= self.verify_workers <= 256,
            "verify_workers",
            self.verify_workers,
            "an integer from 1 to 256",
        )
        if self.model == "mobilenet_v2":
            require(self.channels == 3, "channels", self.channels, "3 with --model mobilenet_v2")
            require(self.image_size >= 32, "image_size", self.image_size, ">= 32 with --model mobilenet_v2")
        if self.weights is not None:
            require(
                self.model == "mobilenet_v2",
                "weights",
                self.weights,
                "unset unless --model mobilenet_v2 (the CNN has no pretrained weights)",
            )
            require(os.path.isfile(self.weights), "weights", self.weights, "an existing local weights file")
