"""What every rank of the exactness harness imports, imported once by the fork server that
starts them (:func:`harness.run_variants`).

A rank started afresh imports torch, torchtitan and the package itself, about 6 s of CPU
a rank; forked from a server that imported them, it starts with them loaded. Importing this
module is the server's set-up: it applies :mod:`torchtitan_seq.cpu_compat` first, as every
entry point does, since torchtitan reads the device type at import time.
"""

from torchtitan_seq import cpu_compat

cpu_compat.apply()

import torchtitan.components.loss  # noqa: E402,F401  (after cpu_compat.apply, as its rule says)
import torchtitan.models.llama3.infra.parallelize  # noqa: E402,F401

import bottom_right  # noqa: E402,F401
import forked_run  # noqa: E402,F401  (the end-to-end runs of jobs known to be valid)
import harness  # noqa: E402,F401
import mutations  # noqa: E402,F401
import settings_walk  # noqa: E402,F401
import torchtitan_seq.models.llama3_seq  # noqa: E402,F401
import torchtitan_seq.pipeline  # noqa: E402,F401
import torchtitan_seq.schedules  # noqa: E402,F401
import torchtitan_seq.stage  # noqa: E402,F401
import torchtitan_seq.train  # noqa: E402,F401
import torchtitan_seq.trainer  # noqa: E402,F401  (the settings walk's ranks)
