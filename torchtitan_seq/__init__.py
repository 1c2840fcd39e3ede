"""torchtitan_seq: sequence-level pipeline schedules for torch.distributed.pipelining and torchtitan.

Importing the package makes torchtitan 0.2.2 runnable on a machine without
CUDA (:mod:`torchtitan_seq.cpu_compat`, a no-op with CUDA) before any of its
modules import torchtitan. :func:`torchtitan_seq.registration.register`
makes the model, dataset and schedules known to torchtitan.
"""

from . import cpu_compat

cpu_compat.apply()

__version__ = "0.1.0"
