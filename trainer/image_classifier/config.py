"""Flags of the image classifier, described in the flag table (:data:`kubetrain_contract.flags.IMAGE_CLASSIFIER`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from kubetrain_contract.flags import IMAGE_CLASSIFIER, TrainerFlags
from trainer.common.config import TrainerConfig, require, table_field

__all__ = ["ClassifierConfig"]


@dataclass
class ClassifierConfig(TrainerConfig):
    """Flags of the image classifier: the common ones and these; bounds and rules are the table's."""

    FLAGS: ClassVar[TrainerFlags] = IMAGE_CLASSIFIER

    model: str = table_field(IMAGE_CLASSIFIER, "model")
    learning_rate: float = table_field(IMAGE_CLASSIFIER, "learning_rate")
    image_size: int = table_field(IMAGE_CLASSIFIER, "image_size")
    channels: int = table_field(IMAGE_CLASSIFIER, "channels")
    filters: int = table_field(IMAGE_CLASSIFIER, "filters")
    alpha: float = table_field(IMAGE_CLASSIFIER, "alpha")
    weights: str | None = table_field(IMAGE_CLASSIFIER, "weights")
    freeze_base: bool = table_field(IMAGE_CLASSIFIER, "freeze_base")
    dropout: float = table_field(IMAGE_CLASSIFIER, "dropout")
    augment: bool = table_field(IMAGE_CLASSIFIER, "augment")
    flip: bool = table_field(IMAGE_CLASSIFIER, "flip")
    shuffle_buffer: int = table_field(IMAGE_CLASSIFIER, "shuffle_buffer")
    verify_workers: int = table_field(IMAGE_CLASSIFIER, "verify_workers")
    prepared_dir: str | None = table_field(IMAGE_CLASSIFIER, "prepared_dir")

    def __post_init__(self) -> None:
        super().__post_init__()
        # The one check the table cannot make: the file is on this pod's disk.
        if self.weights is not None:
            require(os.path.isfile(self.weights), "weights", self.weights, "an existing local weights file")
