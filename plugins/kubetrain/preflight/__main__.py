"""``python -m kubetrain.preflight``: the preflight's command line (:mod:`kubetrain.preflight.cli`)."""

import sys

from kubetrain.preflight.cli import main

# Airflow's plugin manager imports every file of the plugins folder as a top-level module named by its stem,
# this one as "__main__" with no package: only `python -m kubetrain.preflight` runs the command line.
if __name__ == "__main__" and __package__ == "kubetrain.preflight":
    sys.exit(main())
