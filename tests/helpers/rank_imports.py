"""What every rank of the exactness harness imports, imported once by the fork server that
starts them (:func:`harness.run_variants`).

A rank started afresh imports torch, torchtitan and the package itself, about 6 s of CPU
a rank; forked from a server that imported them, it starts with them loaded. Importing this
module is the server's set-up: it applies :mod:`torchtitan_seq.titan.cpu_compat` first, as every
entry point does, since torchtitan reads the device type at import time. It imports what the
installed torchtitan's harness uses (:mod:`harness_titan`) and the settings walk's trainer (0.3's
config functions, which import it); under 0.2.2 also the forked end-to-end runs' modules.
"""

from torchtitan_seq.titan import cpu_compat

cpu_compat.apply()

import torchtitan.components.loss  # noqa: E402,F401  (after cpu_compat.apply, as its rule says)

import bottom_right  # noqa: E402,F401
import harness  # noqa: E402,F401
import harness_titan  # noqa: E402,F401
import mutations  # noqa: E402,F401
import settings_walk  # noqa: E402,F401
import torchtitan_seq.schedules  # noqa: E402,F401
import torchtitan_seq.schedules.stage  # noqa: E402,F401
import torchtitan_seq.titan.pipeline_core  # noqa: E402,F401
import torchtitan_seq.train  # noqa: E402,F401  (the settings walk's ranks set up as a user's job)
from torchtitan_seq.titan.version import TITAN_03  # noqa: E402

if TITAN_03:
    import torchtitan.distributed.pipeline_parallel  # noqa: F401
    import torchtitan.models.llama3  # noqa: F401

    import torchtitan_seq.recipes  # noqa: F401  (the settings walk's jobs and trainer)
    import torchtitan_seq.titan.v03.model  # noqa: F401
    import torchtitan_seq.titan.v03.pipeline  # noqa: F401
else:
    import torchtitan.models.llama3.infra.parallelize  # noqa: F401

    import forked_run  # noqa: F401  (the end-to-end runs of jobs known to be valid)
    import torchtitan_seq.titan.v022.models.llama3_seq  # noqa: F401
    import torchtitan_seq.titan.v022.pipeline  # noqa: F401
    import torchtitan_seq.titan.v022.trainer  # noqa: F401  (the settings walk's ranks)
