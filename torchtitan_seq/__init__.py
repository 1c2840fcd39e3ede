"""torchtitan_seq: sequence-level pipeline schedules for torch.distributed.pipelining and torchtitan.

Importing any module of the package changes nothing in torch or torchtitan.
The training entry point (:mod:`torchtitan_seq.train`) applies the CPU
compatibility torchtitan 0.2.2 needs without CUDA
(:func:`torchtitan_seq.cpu_compat.apply`) and registers the model, dataset and
schedules with torchtitan (:func:`torchtitan_seq.registration.register`).
"""

__version__ = "0.1.0"
