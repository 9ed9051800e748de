"""``torchrun ... tests/parity/__main__.py --model gpt``: `tests.parity.run.main` on each rank."""

import os
import sys

if __package__ in (None, ""):  # run as a script by torchrun: make `tests` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.parity.run import main

main()
