"""``python -m torchtitan_seq.plan``: see :mod:`.cli`."""

import os
import sys

from torchtitan_seq.plan.cli import main

code = main()  # the cyclic collector off since the package's imports (see its top); plan() leaves it so
# Out without the interpreter's teardown, which would free the search's cached action lists one object
# at a time after the answer is printed; the planner holds nothing else to release.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
