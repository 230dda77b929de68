"""`python -m lumo ...`: the `lumo` command, where the console script is not on PATH (PYTHONPATH=. runs)."""

import sys

from .cli import main

sys.exit(main())
