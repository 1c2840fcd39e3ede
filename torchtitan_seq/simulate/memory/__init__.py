"""Memory model in bytes: what one pipeline rank holds at its peak, by arithmetic.

:func:`predict_memory` takes a :class:`MemoryConfig` (a flavor of any family, or its shape or
``TransformerModelArgs``, the job's :class:`~torchtitan_seq.runtime.shape.JobShape`, schedule, parallel
degrees, activation checkpointing, dtypes) and returns a :class:`MemoryEstimate`: per rank and for the
fullest rank, parameters, gradients, optimizer states, activations, the KV context's
extra, a transient workspace and the pipeline's receive buffers, in bytes, and the most K/V its KV
contexts hold (``kv_held``: ``kv_context = "reach"`` or ``"full"``). No model is
built and nothing runs on a device: per-token byte counts times token counts, walked
along each rank's action list from the simulator's :func:`~torchtitan_seq.simulate.build.build` (the very
lists the runtime executes; memory on a rank depends only on the order of its own
actions, not on their timing).

Notation: D = ``dim``, H and Hkv query and K/V heads, hd the head width (D / H in Llama 3), F = the MLP
width a token runs through (:func:`~torchtitan_seq.runtime.model_counts.mlp_width`: an MoE layer's
active experts), V = vocabulary, t = TP degree, a =
bytes of the compute dtype, b = microbatch size, L_j = tokens of unit j (the whole
sequence for torch's schedules).

The model, one concept a module: :mod:`.config` (the job and its dtypes), :mod:`.chunks` (what each
chunk holds, where stages run), :mod:`.activations` (bytes a token saves, per checkpointing mode),
:mod:`.stage_bytes` (a stage's units, the KV context's slab, context parallelism), :mod:`.reach` (what
layers of bounded reach keep), :mod:`.arenas` (the KV context's arenas),
:mod:`.actions` (each rank's actions, built once per shape), :mod:`.walk` (the
activation peaks along them), :mod:`.states` (parameters, gradients, optimizer), :mod:`.workspace`,
:mod:`.buffers` (receive buffers), :mod:`.estimate` (:func:`predict_memory`) and :mod:`.floor`
(:func:`memory_floor`: a lower bound without the lists, or without arenas or a walk, which a search
asks first).
"""

from __future__ import annotations

# Beside __all__, the submodules' names that the tests reach as torchtitan_seq.simulate.memory.<name>.
from torchtitan_seq.runtime.kv_placement import plan_arenas  # noqa: F401
from torchtitan_seq.runtime.model_counts import ffn_hidden_dim  # noqa: F401
from torchtitan_seq.simulate.memory.actions import ActionPlan, Events, action_plan, all_forwards_first, pass_events  # noqa: F401
from torchtitan_seq.simulate.memory.activations import (  # noqa: F401
    family_bytes,
    layer_bytes,
    norm_bytes,
    recomputed_fraction,
    saved_per_token,
)
from torchtitan_seq.simulate.memory.arenas import slab_arena_events  # noqa: F401
from torchtitan_seq.simulate.memory.buffers import buffer_bytes, buffer_bytes_per_token  # noqa: F401
from torchtitan_seq.simulate.memory.chunks import ChunkLayout, chunk_kinds, chunk_layout, memory_chunk_split  # noqa: F401
from torchtitan_seq.simulate.memory.config import DTYPE_BYTES, ACMode, Device, DType, MemoryConfig, dtype_bytes  # noqa: F401
from torchtitan_seq.simulate.memory.estimate import MemoryEstimate, RankMemory, gib, predict_memory  # noqa: F401
from torchtitan_seq.simulate.memory.floor import memory_floor  # noqa: F401
from torchtitan_seq.simulate.memory.reach import bounded_layers, reach_positions  # noqa: F401
from torchtitan_seq.simulate.memory.stage_bytes import StageBytes, bytes_of_stage, chain_bytes  # noqa: F401
from torchtitan_seq.simulate.memory.states import StateRates, state_bytes, state_rates  # noqa: F401
from torchtitan_seq.simulate.memory.walk import memory_walks  # noqa: F401
from torchtitan_seq.simulate.memory.workspace import workspace_bytes, workspace_per_token  # noqa: F401

__all__ = [
    "MemoryConfig",
    "RankMemory",
    "MemoryEstimate",
    "predict_memory",
    "memory_floor",
    "gib",
    "DType",
    "DTYPE_BYTES",
    "ACMode",
    "Device",
]
