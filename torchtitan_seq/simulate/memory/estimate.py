"""The estimate: what each rank holds at its peak, by kind, and the fullest rank (:func:`predict_memory`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.memory.actions import action_plan
from torchtitan_seq.simulate.memory.buffers import buffer_bytes
from torchtitan_seq.simulate.memory.chunks import memory_chunk_split
from torchtitan_seq.simulate.memory.config import MemoryConfig, dtype_bytes
from torchtitan_seq.simulate.memory.reach import reach_extents
from torchtitan_seq.simulate.memory.stage_bytes import chain_bytes
from torchtitan_seq.simulate.memory.states import state_bytes
from torchtitan_seq.simulate.memory.walk import memory_walks
from torchtitan_seq.simulate.memory.workspace import workspace_bytes


def gib(nbytes: float) -> float:
    """Bytes in GiB (2^30)."""
    return nbytes / 2**30


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by kind (the package's docstring names the module of each), and
    the K/V its KV contexts hold at most (``kv_held``, not a part of the total)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    kv_context: int
    workspace: int
    buffers: int
    kv_held: int = 0
    """The most K/V the rank's KV contexts hold at once (their arenas and slabs, each once; not their
    gradients), what the metrics' ``peak_kv_bytes`` measures. Part of it is among the activations (the
    slabs autograd saves views of), the rest in ``kv_context``, so the total leaves it out."""

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.kv_context
            + self.workspace
            + self.buffers
        )

    def gib(self) -> dict[str, float]:
        """Every field and the total, in GiB."""
        return {f.name: gib(getattr(self, f.name)) for f in dataclasses.fields(RankMemory)} | {"total": gib(self.total)}


@dataclass(frozen=True)
class MemoryEstimate(RankMemory):
    """The fullest rank's :class:`RankMemory` (its index ``rank``), and every rank's."""

    rank: int = 0
    ranks: tuple[RankMemory, ...] = field(default=(), repr=False)


def predict_memory(config: MemoryConfig) -> MemoryEstimate:
    """Peak bytes per rank of ``config``'s job; the fullest rank's fields at the top level."""
    args, c = config.model_args, config
    a = dtype_bytes(c.activation_dtype, "compute_dtype")
    lengths = c.shape.lengths
    n, k = c.shape.microbatches, c.shape.num_subsequences
    plan = action_plan(c.schedule, c.pp, n, k, c.shape.stages_per_rank, c.split_backward)
    chunks = memory_chunk_split(args.n_layers, plan.chain_length)
    tokens = [length * c.microbatch_size for length in lengths]
    is_sequence = c.schedule in SEQUENCE_SCHEDULES

    per_chunk = chain_bytes(args, c, a, chunks, tokens, is_sequence)
    weights = {s: per_chunk[s % plan.chain_length] for s in plan.stages}
    ranks = []
    reach = getattr(args, "reach", None)  # the copied slabs' arenas, planned from their rows in use
    extents = reach_extents(tuple(lengths), reach) if reach is not None else None
    walks = memory_walks(plan, weights, tuple(lengths), n, c.cp > 1, c.kv_offload, extents)
    for r, (act, combined, held) in enumerate(walks):
        ranks.append(
            RankMemory(
                **state_bytes(args, c, plan, chunks, r),
                activations=round(act),
                kv_context=round(combined - act),
                workspace=round(workspace_bytes(args, c, a, plan, chunks, r, max(tokens) / c.cp, is_sequence)),
                buffers=round(buffer_bytes(args, c, a, plan, chunks, r, lengths)),
                kv_held=round(held),
            )
        )
    worst = max(range(c.pp), key=lambda r: ranks[r].total)
    return MemoryEstimate(**dataclasses.asdict(ranks[worst]), rank=worst, ranks=tuple(ranks))
