"""``python -m trainer.dialogue``: see ``trainer.dialogue.train``."""

from __future__ import annotations

import sys

from trainer.dialogue.train import main

if __name__ == "__main__":
    sys.exit(main())
