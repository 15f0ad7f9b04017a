"""``python -m experiments.mini``: the miniature of the paper's experiment (see :mod:`experiments.mini.cli`)."""

import sys

from experiments.mini.cli import main

sys.exit(main(sys.argv[1:]))
