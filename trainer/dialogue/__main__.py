"""``python -m trainer.dialogue``: see ``trainer.dialogue.train``."""

from __future__ import annotations

from trainer.common.cli import exit_process
from trainer.dialogue.train import main

if __name__ == "__main__":
    exit_process(main())
