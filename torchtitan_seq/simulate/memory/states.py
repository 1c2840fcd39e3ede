"""Parameters, gradients and optimizer states: the bytes a rank holds per parameter of its stages.

**Parameters, gradients, optimizer** per parameter of every stage the rank holds (BSIPipe's
and Chimera's mirrored copies: each chunk twice over a pair of ranks, ``parameter_copies``
2): parameters as FSDP shards them over ``dp_shard`` (``param_dtype``), plus the
unsharded compute copy that FSDP keeps through a pipeline step (torchtitan does not
reshard after forward under PP; without PP a layer's copy is transient) or, without FSDP,
a compute copy when its dtype differs; gradients in the reduce dtype, unsharded under PP
(FSDP accumulates a step's microbatches unsharded and reduce-scatters after the last
backward; both copies of a mirrored chunk get one), sharded without PP; optimizer states
(``optimizer_states`` x ``optimizer_dtype``) sharded over ``dp_shard``, for chain A's copy only
(:class:`~torchtitan_seq.schedules.MirroredCopies` drops the mirror's gradients before the step,
so AdamW never makes its states). TP divides every matrix and the embeddings by t (norm
weights stay whole). Gradients are counted whole at the activation peak, an upper bound
(early in a step some are not allocated yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torchtitan_seq.simulate.memory.actions import ActionPlan
from torchtitan_seq.simulate.memory.chunks import Chunks
from torchtitan_seq.simulate.memory.config import MemoryConfig, dtype_bytes
from torchtitan_seq.simulate.network import chunk_parameters

if TYPE_CHECKING:  # torchtitan is imported where a flavor is looked up, not with this module
    from torchtitan.models.llama3 import TransformerModelArgs


class StateRates(NamedTuple):
    """Bytes a rank holds per parameter of a stage it holds."""

    parameters: float
    gradients: float
    optimizer: float
    """Per parameter of chain A's copy only (see the module docstring)."""


def state_rates(c: MemoryConfig) -> StateRates:
    """Bytes per parameter of ``c``'s job (see the module docstring)."""
    master, compute = dtype_bytes(c.param_dtype, "param_dtype"), dtype_bytes(c.activation_dtype, "compute_dtype")
    if c.fsdp:
        # Under PP torchtitan keeps the unsharded copy through the step and the schedule
        # reduce-scatters after the last backward; without PP each layer reshards after use
        # and every backward reduce-scatters.
        pipelined = c.pp > 1
        per_param = master / c.fsdp_degree + (compute if pipelined else 0)
        grad = dtype_bytes(c.mixed_precision_reduce, "mixed_precision_reduce")
        grad_per_param = grad if pipelined else grad / c.fsdp_degree
    else:
        per_param = master + (compute if compute != master else 0)
        grad_per_param = master
    optimizer = c.optimizer_states * dtype_bytes(c.optimizer_dtype, "optimizer_dtype") / c.fsdp_degree
    return StateRates(per_param, grad_per_param, optimizer)


def state_bytes(
    args: TransformerModelArgs, c: MemoryConfig, plan: ActionPlan, chunks: Chunks, rank: int
) -> dict[str, int]:
    """``rank``'s parameters, gradients and optimizer states, in bytes, keyed as
    :class:`~.estimate.RankMemory`'s fields."""
    held = [chunk_parameters(args, *chunks[s % plan.chain_length], c.tp) for s in plan.stages_of(rank)]
    primary = [
        chunk_parameters(args, *chunks[s % plan.chain_length], c.tp)
        for s in plan.stages_of(rank)
        if s < plan.chain_length
    ]
    rates = state_rates(c)
    return {
        "parameters": round(sum(held) * rates.parameters),
        "gradients": round(sum(held) * rates.gradients),
        "optimizer": round(sum(primary) * rates.optimizer),
    }
