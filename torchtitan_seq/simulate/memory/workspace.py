"""The workspace: the largest transient of one pass on a rank.

**Workspace** (an estimate, not measured): the largest transient of one pass on the rank,
on top of what it holds: on a last stage the loss's logits in the compute dtype, their
float32 copy and gradient, (8 + a) V / t a token; in every layer's backward the MLP's
and attention's input gradients, a (2F + 2D + 2 Hkv hd) / t a token (F the widest layer's: an
MoE layer's active width; MLA's K and V), plus with k > 1 the
unit attention's float32 merge of prefix blocks, 8D/t; times b and the longest unit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_seq.runtime.model_counts import kv_values, mlp_width
from torchtitan_seq.simulate.memory.actions import ActionPlan
from torchtitan_seq.simulate.memory.chunks import Chunks
from torchtitan_seq.simulate.memory.config import MemoryConfig

if TYPE_CHECKING:  # torchtitan is imported where a flavor is looked up, not with this module
    from torchtitan.models.llama3 import TransformerModelArgs


def workspace_per_token(
    args: TransformerModelArgs, c: MemoryConfig, a: int, chunk: tuple[float, bool, bool], unit: bool
) -> float:
    """The largest transient of a pass on a stage running ``chunk``, per token of its longest unit."""
    d, t, f = args.dim, c.tp, mlp_width(args, widest=True)
    layers, _, last = chunk
    per_token = a * (2 * f + 2 * d + kv_values(args)) / t if layers else 0.0
    if unit and c.shape.num_subsequences > 1 and layers:
        per_token += 8 * d / t
    if last:
        per_token = max(per_token, (8 + a) * args.vocab_size / t)
    return per_token


def workspace_bytes(
    args: TransformerModelArgs,
    c: MemoryConfig,
    a: int,
    plan: ActionPlan,
    chunks: Chunks,
    rank: int,
    longest: int,
    unit: bool,
) -> float:
    """The largest transient of a pass on ``rank``'s stages, on units of ``longest`` tokens."""
    chunks_held = (chunks[s % plan.chain_length] for s in plan.stages_of(rank))
    return max(workspace_per_token(args, c, a, chunk, unit) for chunk in chunks_held) * longest
