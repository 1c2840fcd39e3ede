"""torchtitan_seq: sequence-level pipeline schedules for torch.distributed.pipelining and torchtitan.

The package's folders are its layers, each importing only from those before it:

* :mod:`~torchtitan_seq.runtime`: units and the KV context, the sequence cut, CP inside units, packed
  documents, RoPE positions, the loss, torch's private names (plain torch);
* :mod:`~torchtitan_seq.attention` (unit attention and its kernels) and
  :mod:`~torchtitan_seq.instrumentation` (activation memory, timeline, rendering);
* :mod:`~torchtitan_seq.schedules`: the schedules, their ordering rules and the pipeline stage;
* :mod:`~torchtitan_seq.titan`: the integration with torchtitan, what both versions share and a thin
  layer per version (``titan.v022``, ``titan.v03``);
* the tools, apart: :mod:`~torchtitan_seq.simulate` (the simulator and the memory model) and
  :mod:`~torchtitan_seq.plan` (the planner).

At the root: this module (the public API below), :mod:`torchtitan_seq.train` (``python -m
torchtitan_seq.train``), :mod:`torchtitan_seq.config` (named in TOML files) and
:mod:`torchtitan_seq.recipes` (torchtitan 0.3's ``--module``).

The public API, imported from here (``from torchtitan_seq import ScheduleSeq1F1B``) when first asked
for: the schedule classes and their table, :class:`SequencePipelineStage`, :func:`partition_sequence`,
:class:`KVContext`, :class:`SequenceAttention` and :func:`bind_kv_context`,
:class:`TokenNormalizedLoss` and :func:`register` (the installed torchtitan version's registration).
Importing the package changes nothing in torch or torchtitan; the training entry point
(:mod:`torchtitan_seq.train`) applies the CPU compatibility and registers with torchtitan.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "torchtitan_seq.schedules": (
        "SEQUENCE_SCHEDULES",
        "ScheduleShape",
        "SequenceSchedule",
        "ScheduleSeq1F1B",
        "ScheduleInterleavedSeq1F1B",
        "ScheduleBSIPipe",
        "ScheduleChimera",
        "ScheduleTeraPipe",
    ),
    "torchtitan_seq.schedules.stage": ("SequencePipelineStage",),
    "torchtitan_seq.runtime.partition": ("partition_sequence",),
    "torchtitan_seq.runtime.kv_context": ("KVContext",),
    "torchtitan_seq.runtime.loss": ("TokenNormalizedLoss",),
    "torchtitan_seq.attention": ("SequenceAttention", "bind_kv_context"),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = [*_MODULE_OF, "register"]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use, so that importing the package stays light.

    Args:
        name: a name of ``__all__``.

    Returns:
        The object; ``register`` is the installed torchtitan version's registration.

    Raises:
        AttributeError: ``name`` is not public.
    """
    if name == "register":
        from torchtitan_seq.titan.version import TITAN_03

        version = "v03" if TITAN_03 else "v022"
        return importlib.import_module(f"torchtitan_seq.titan.{version}.registration").register
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'torchtitan_seq' has no attribute {name!r}")
