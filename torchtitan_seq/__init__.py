"""torchtitan_seq: sequence-level pipeline schedules for torch.distributed.pipelining and torchtitan.

Importing any module of the package changes nothing in torch or torchtitan; the training entry point
(:mod:`torchtitan_seq.train`) applies :mod:`torchtitan_seq.cpu_compat` and registers with torchtitan.
"""

__version__ = "0.1.0"
