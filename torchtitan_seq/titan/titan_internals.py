"""torchtitan's private names, in one place, each with its reason (as
:mod:`torchtitan_seq.runtime.torch_internals` keeps torch's).

Each is reached through a function that imports it when called: a name exists only under the
torchtitan version whose layer calls it (0.2.2's ``titan.v022``, 0.3's ``titan.v03``), and importing
this module imports no torchtitan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["registered_train_specs", "llm_fqn_per_model_part", "split_module"]


def registered_train_specs() -> dict[str, Any]:
    """torchtitan 0.2.2's table of the train specs registered by name.

    ``torchtitan.protocols.train_spec._extra_train_specs``: ``register_train_spec`` raises on a name
    already there, and no public function asks whether one is, so registering stays idempotent by
    reading the table.

    Returns:
        The table itself, by model name.
    """
    from torchtitan.protocols import train_spec

    return train_spec._extra_train_specs


def llm_fqn_per_model_part() -> Callable[..., list[list[str]]]:
    """torchtitan 0.3's split of a decoder LLM's module names into model parts.

    ``torchtitan.distributed.pipeline_parallel._generate_llm_fqn_per_model_part``: the sequence
    schedules cut chunks as torchtitan's own pipelines do, and 0.3 keeps the function private.

    Returns:
        The function, called as ``(chunks, layers, first-stage less layers, last-stage less layers)``;
        it returns the module names of each chunk, in model order.
    """
    from torchtitan.distributed import pipeline_parallel

    return pipeline_parallel._generate_llm_fqn_per_model_part


def split_module(model: nn.Module, module_names: list[str]) -> nn.Module:
    """torchtitan 0.3's pipeline chunk of a model: a copy holding only the named modules.

    ``torchtitan.distributed.pipeline_parallel._split_module``: how 0.3 builds a pipeline chunk.

    Args:
        model: the whole model.
        module_names: the chunk's module names (FQNs).

    Returns:
        The chunk.
    """
    from torchtitan.distributed import pipeline_parallel

    return pipeline_parallel._split_module(model, module_names)
