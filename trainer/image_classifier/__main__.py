"""``python -m trainer.image_classifier``: see ``trainer.image_classifier.train``."""

from __future__ import annotations

from trainer.common.cli import exit_process
from trainer.image_classifier.train import main

if __name__ == "__main__":
    exit_process(main())
