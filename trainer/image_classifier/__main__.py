"""``python -m trainer.image_classifier``: see ``trainer.image_classifier.train``."""

from __future__ import annotations

import sys

from trainer.image_classifier.train import main

if __name__ == "__main__":
    sys.exit(main())
