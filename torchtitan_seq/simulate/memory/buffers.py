"""The receive buffers torch's pipeline stages allocate.

**Buffers**: torch's pipeline stage allocates a receive buffer for every microbatch
(unit) of the step when it sets up: activations into every stage but a chain's first,
gradients into every stage but its last, b L_j aD/t each, held for the whole step. They
scale with N, whatever the schedule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_seq.simulate.memory.actions import ActionPlan
from torchtitan_seq.simulate.memory.chunks import Chunks
from torchtitan_seq.simulate.memory.config import MemoryConfig

if TYPE_CHECKING:  # torchtitan is imported where a flavor is looked up, not with this module
    from torchtitan.models.llama3 import TransformerModelArgs


def buffer_bytes(
    args: TransformerModelArgs, c: MemoryConfig, a: int, plan: ActionPlan, chunks: Chunks, rank: int, lengths: list[int]
) -> float:
    """Receive buffers of ``rank``'s stages over a step of ``c.shape.microbatches``, units of ``lengths``."""
    scale = c.shape.microbatches / plan.built_microbatches
    forwards = plan.forwards_of(rank, len(lengths))
    total = 0.0
    for s in plan.stages_of(rank):
        tokens = float(sum(count * length for count, length in zip(forwards[s], lengths)))
        total += tokens * scale * buffer_bytes_per_token(args, c, a, chunks[s % plan.chain_length])
    return total


def buffer_bytes_per_token(
    args: TransformerModelArgs, c: MemoryConfig, a: int, chunk: tuple[float, bool, bool]
) -> float:
    """Receive buffers of a stage running ``chunk``, per token of the units it runs: activations in
    but into a chain's first stage, gradients in but into its last."""
    _, first, last = chunk
    return ((not first) + (not last)) * c.microbatch_size * a * args.dim / (c.tp * c.cp)
