"""Memory model in bytes: what one pipeline rank holds at its peak, by arithmetic.

:func:`predict_memory` takes a :class:`MemoryConfig` (a torchtitan Llama 3 flavor or
``TransformerModelArgs``, the job's :class:`~torchtitan_seq.shape.JobShape`, schedule, parallel
degrees, activation checkpointing, dtypes) and returns a :class:`MemoryEstimate`: per rank and for the
fullest rank, parameters, gradients, optimizer states, activations, the KV context's
extra, a transient workspace and the pipeline's receive buffers, in bytes. No model is
built and nothing runs on a device: per-token byte counts times token counts, walked
along each rank's action list from the simulator's :func:`~.build.build` (the very
lists the runtime executes; memory on a rank depends only on the order of its own
actions, not on their timing).

Notation: D = ``dim``, H and Hkv query and K/V heads, hd = D / H, F = the MLP width
(:func:`~torchtitan_seq.partition.ffn_hidden_dim`), V = vocabulary, t = TP degree, a =
bytes of the compute dtype, b = microbatch size, L_j = tokens of unit j (the whole
sequence for torch's schedules). A chunk is the part of the model a stage runs: torchtitan's
``generate_llm_fqn_per_model_part`` split (embeddings and norm + output weighted as one
layer each; :func:`~torchtitan_seq.flavors.chunk_split` computes it without torchtitan), or, when
that split has an empty chunk (more chunks than layers), an even real-valued share of the layers,
embeddings on the first chunk and the output on the last.

**Activations** (what autograd saves for backward, the figure
:class:`torchtitan_seq.memory.ActivationMemory` measures). Per token and layer, as
torchtitan's ``TransformerBlock`` saves it with the project's attention (checked against
autograd's saved tensors on the CPU, ``tests/unit/test_memory_model.py``):

* ``none``: each RMSNorm's input (the block input x, and h = x + attention; D/t each under
  sequence parallel) and 1/rms, aD/t + 4/t per norm with CUDA's fused kernel, 8D/t + 4/t
  with the CPU's composite form (it keeps x upcast to float32 and x/rms, both float32);
  the normed inputs of the attention and MLP projections, gathered to whole tokens under
  TP, 2aD; q, the attention output (the output projection saves the same storage), K and
  V, the MLP's w1 and w3 outputs, SiLU's output and their product, a (2D + 2 Hkv hd + 4F) / t;
  the log-sum-exp, 4H/t; for a unit, its RoPE rows (hd/2 complex64, 4 hd). The whole RoPE
  table (4 S hd) is saved once per stage where layers get it whole: torch's schedules, and
  checkpointed blocks (an input).
* ``full`` (every block checkpointed): the block input, aD/t; units add their positions
  (8 bytes a token, once per stage).
* ``selective`` with ``selective_ac_option = "op"``: the input plus what torchtitan's op
  list keeps: the outputs of every other matmul (wq, wv, w1, w2) and of TP's
  reduce-scatter: a (2D + Hkv hd + F) / t + aD (w2's output, before its reduce-scatter
  under TP, plus aD/t after it when t > 1). The unit attention op is not in the list, so
  it is recomputed and the KV context keeps K/V (below). Not measurable with
  ``ActivationMemory`` (selective checkpointing's cache bypasses saved-tensor hooks).
* ``selective`` with an integer option n: every n-th block checkpointed: 1/n of the
  layers at ``full``'s bytes, the rest at ``none``'s.

Stages add: the first, the token ids (8 bytes a token); the last, the final norm, its
gathered output (aD, the output projection's input) and the loss's log-softmax in
float32 with the labels (4V/t + 8). A unit of stage s holds b L_j times its chunk's
per-token bytes from its forward until its backward (B, or W where backward is split).

**KV context** (:mod:`torchtitan_seq.kv_context`): per stage, microbatch and layer one K/V
slab of the keys later units read, S - L_{k-1} tokens at 2 Hkv hd a / t bytes each (torch's
kernels, which align causal masks top-left: the last unit keeps its own K/V), in arenas the
context plans from the stage's pass order as the runtime does
(:func:`~torchtitan_seq.kv_placement.plan_arenas`: a microbatch in backward and the next in
forward share one arena from its two ends), each allocated by a write into it while it holds no
slab in use and let go at the end of the last backward (B, or W where backward is split) of a
slab in it:

* without checkpointing the units' attention saves views of the arenas, so they are among the
  saved activations (the own K/V of units 0..k-2 then are not: their per-unit bytes above
  less 2 Hkv hd a / t a layer);
* under checkpointing (``full``, op-level ``selective``, and the checkpointed 1/n of
  layer-level ``selective``) the context alone keeps it;
* in every mode, the slab's gradient (:meth:`~torchtitan_seq.kv_context.KVSlab.accumulate`):
  the keys before the last unit, S - L_{k-1} tokens, from the microbatch's first backward
  (its input-gradient pass) to the slab's end.

**Context parallelism** (the shape's ``cp`` = c, :mod:`torchtitan_seq.context_parallel`): a rank
computes 1/c of every unit's tokens, so every per-token figure above (activations, workspace, receive
buffers) counts b L_j / c tokens, but its slab holds the whole sequence's K/V, S tokens (the last
unit's too: other CP ranks' queries read it as their prefix), as does the slab's gradient; the
units' attention saves views of it for their own K/V, the last unit's included. FSDP shards over
``dp_shard`` x c ranks.

``kv_context`` is what these add to the peak: the largest activations + context over the
rank's actions, less the activation peak (so activations + kv_context is that sum's peak).

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

**Workspace** (an estimate, not measured): the largest transient of one pass on the rank,
on top of what it holds: on a last stage the loss's logits in the compute dtype, their
float32 copy and gradient, (8 + a) V / t a token; in every layer's backward the MLP's
and attention's input gradients, a (2F + 2D + 2 Hkv hd) / t a token, plus with k > 1 the
unit attention's float32 merge of prefix blocks, 8D/t; times b and the longest unit.

**Buffers**: torch's pipeline stage allocates a receive buffer for every microbatch
(unit) of the step when it sets up: activations into every stage but a chain's first,
gradients into every stage but its last, b L_j aD/t each, held for the whole step. They
scale with N, whatever the schedule.

The peak of a schedule whose backwards interleave its forwards is reached within
2p + (N mod p) microbatches, so the action lists are built for at most that many
(BSIPipe's basic unit is 2p) and cached per shape; where a rank runs all its forwards
before any backward (GPipe, TeraPipe) the peak grows with N and is scaled by N / N'.
Calls after the first for a shape take milliseconds; building BSIPipe's lists at
p = 16 takes seconds once. :func:`memory_floor` bounds the total from below without the
lists (each rank's states, workspace and buffers, and one microbatch in flight on its
stages of one chain) or with them but without arenas or a walk (what each rank holds where
it holds the most units): a search asks it first.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from ..flavors import ModelShape, chunk_split, flavor_shape, flavor_shapes
from ..kv_placement import Pass, plan_arenas
from ..ordering import B, F, I, W, compute_leaves, stage_passes
from ..partition import ffn_hidden_dim
from ..schedules import SEQUENCE_SCHEDULES
from ..shape import JobShape
from .build import SimConfig, build, stages_by_rank
from .network import chunk_parameters

if TYPE_CHECKING:  # torchtitan is imported where a flavor is looked up, not with this module
    from torchtitan.models.llama3 import TransformerModelArgs

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

DType = Literal["float32", "bfloat16", "float16", "float8_e4m3fn"]
"""The dtypes a config may name (torchtitan's names)."""
DTYPE_BYTES: dict[DType, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}

ACMode = Literal["none", "selective", "full"]
"""``activation_checkpoint.mode``s the model covers, least recomputation first."""
Device = Literal["cuda", "cpu"]


def gib(nbytes: float) -> float:
    """Bytes in GiB (2^30)."""
    return nbytes / 2**30


@dataclass(frozen=True)
class MemoryConfig:
    """One training job, as torchtitan's config names it: the model, the job's shape and the rest."""

    model: str | TransformerModelArgs
    """A ``llama3_seq`` flavor name (``seq_llama3_flavors``) or the model's arguments."""
    shape: JobShape
    """The job's shape as the runtime derives it (:class:`~torchtitan_seq.shape.JobShape`): S, the cut
    into k units (1 for torch's schedules), the TP degree (with sequence parallel, as torchtitan applies
    it), N microbatches per step and pipeline, v (None: the schedule's own). Its ``whole`` follows
    ``schedule``: torch's schedules run each sequence uncut."""
    schedule: str = "1F1B"
    """A name of ``SEQUENCE_SCHEDULES`` or one of torch's schedules."""
    pp: int = 1
    """Pipeline ranks."""
    split_backward: bool = False
    """Separate input- and weight-gradient passes (activations live until W)."""
    microbatch_size: int = 1
    """b, sequences per microbatch (``pipeline_parallel_microbatch_size``)."""
    dp_shard: int = 1
    """``data_parallel_shard_degree``; FSDP shards over it and the CP degree (the shape's ``cp``), and is
    on when their product is above 1, as torchtitan builds its mesh."""
    activation_checkpoint: ACMode = "none"
    """``activation_checkpoint.mode``."""
    selective_ac_option: str = "2"
    """``activation_checkpoint.selective_ac_option``: ``"op"`` or every n-th layer (torchtitan's default 2)."""
    device: Device = "cuda"
    """Where it runs: RMSNorm saves more on the CPU (its composite form, in float32)."""
    param_dtype: DType = "float32"
    """Master weights (FSDP's sharded parameters; torchtitan's parameters)."""
    compute_dtype: DType | None = None
    """Activations and the compute copy of the weights; None: torchtitan's rule,
    ``mixed_precision_param`` under FSDP (or with neither PP nor TP: autocast), else ``param_dtype``
    (torchtitan turns mixed precision off with PP or TP and no FSDP)."""
    mixed_precision_param: DType = "bfloat16"
    """``training.mixed_precision_param``."""
    mixed_precision_reduce: DType = "float32"
    """``training.mixed_precision_reduce``: FSDP's gradient dtype."""
    optimizer_states: int = 2
    """States per parameter (AdamW: 2)."""
    optimizer_dtype: DType = "float32"
    """dtype of the optimizer states."""

    def __post_init__(self) -> None:
        # Whether the job cuts its sequences is the schedule's to say, not the caller's.
        object.__setattr__(self, "shape", replace(self.shape, whole=self.schedule not in SEQUENCE_SCHEDULES))
        for name in ("param_dtype", "mixed_precision_param", "mixed_precision_reduce", "optimizer_dtype"):
            _bytes(getattr(self, name), name)
        if self.compute_dtype is not None:
            _bytes(self.compute_dtype, "compute_dtype")
        if self.activation_checkpoint not in ("none", "selective", "full"):
            raise ValueError(
                f"activation_checkpoint = {self.activation_checkpoint!r}: the memory model knows "
                "'none', 'selective' and 'full' ('memory_budget' depends on the compiler)"
            )
        option = self.selective_ac_option
        if self.activation_checkpoint == "selective" and option != "op" and not (option.isdigit() and int(option)):
            raise ValueError(f"selective_ac_option = {option!r}: use 'op' or a positive integer")
        counts = {
            name: getattr(self.shape, name) for name in ("seq_len", "num_subsequences", "tp", "cp", "microbatches")
        }
        counts |= {"pp": self.pp, "microbatch_size": self.microbatch_size, "dp_shard": self.dp_shard}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} = {value}: it must be at least 1")

    @property
    def model_args(self) -> TransformerModelArgs | ModelShape:
        if not isinstance(self.model, str):
            return self.model
        if (shape := flavor_shape(self.model)) is None:
            raise ValueError(f"model = {self.model!r}: use one of {sorted(flavor_shapes)} or TransformerModelArgs")
        return shape

    @property
    def seq_len(self) -> int:
        """S, tokens per sequence (the shape's), which the byte counts read throughout."""
        return self.shape.seq_len

    @property
    def tp(self) -> int:
        """t, the TP degree (the shape's), which divides most byte counts."""
        return self.shape.tp

    @property
    def cp(self) -> int:
        """c, the CP degree (the shape's): a rank holds 1/c of each unit's tokens, and the whole K/V."""
        return self.shape.cp

    @property
    def fsdp_degree(self) -> int:
        """The ranks FSDP shards over: data-parallel shards x CP."""
        return self.dp_shard * self.cp

    @property
    def fsdp(self) -> bool:
        return self.fsdp_degree > 1

    @property
    def activation_dtype(self) -> str:
        """The compute dtype: activations, and the weights' compute copy."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        if self.fsdp or (self.pp == 1 and self.tp == 1):
            return self.mixed_precision_param
        return self.param_dtype


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by kind (see the module docstring)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    kv_context: int
    workspace: int
    buffers: int

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
    a = _bytes(c.activation_dtype, "compute_dtype")
    lengths = c.shape.lengths
    n, k = c.shape.microbatches, c.shape.num_subsequences
    plan = _plan(c.schedule, c.pp, n, k, c.shape.stages_per_rank, c.split_backward)
    chunks = _chunk_split(args.n_layers, plan.chain_length)
    tokens = [length * c.microbatch_size for length in lengths]
    is_sequence = c.schedule in SEQUENCE_SCHEDULES

    # Stages running alike chunks weigh alike: each chunk's bytes once (a chunk's layers and ends).
    per_chunk = {chunk: _stage_bytes(args, c, a, chunk, tokens, is_sequence) for chunk in set(chunks)}
    weights = {s: per_chunk[chunks[s % plan.chain_length]] for s in plan.stages}
    ranks = []
    for r, (act, combined) in enumerate(_walks(plan, weights, tuple(lengths), n, c.cp > 1)):
        ranks.append(
            RankMemory(
                **_state_bytes(args, c, plan, chunks, r),
                activations=round(act),
                kv_context=round(combined - act),
                workspace=round(_workspace(args, c, a, plan, chunks, r, max(tokens) / c.cp, is_sequence)),
                buffers=round(_buffers(args, c, a, plan, chunks, r, lengths)),
            )
        )
    worst = max(range(c.pp), key=lambda r: ranks[r].total)
    return MemoryEstimate(**dataclasses.asdict(ranks[worst]), rank=worst, ranks=tuple(ranks))


def memory_floor(config: MemoryConfig, walked: bool = False) -> float:
    """A lower bound of ``predict_memory(config).total`` without the schedule's lists (tens of
    microseconds, where the first estimate of a shape builds its lists and plans its arenas, and
    every estimate walks them): a search asks it first and drops what cannot fit.

    Each rank holds its stages' parameters, gradients and optimizer states, its workspace and its
    receive buffers (a chain's stage receives every unit of the chain's microbatches: N, or N / 2
    in each of two chains), as the estimate counts them; the stages come from the schedule's
    placement (:func:`~.build.stages_by_rank`). Of activations it holds, whatever the schedule,
    every unit of some microbatch on each of its stages of one chain at once, with the microbatch's
    slab and each stage's RoPE table: once the microbatch's last unit has run forward on the rank's
    deepest stage of the chain, its units have all run forward on the shallower ones (a forward
    reads the previous stage's output and, for unit j, the stage's K/V of units 0..j-1), and none
    has run backward on any (a backward needs the next stage's input gradient and, on a stage, the
    dK/dV of the units after it, so the last unit's backward on the deepest stage comes first).
    Other microbatches in flight and the arenas' sharing are left out.

    ``walked``: the rank's activations are also at least what its units weigh where it holds the
    most of them (found once per schedule shape, :meth:`_Plan.fullest`); this takes the schedule's
    lists, built once per shape as :func:`predict_memory` builds them, but no arenas and no walk."""
    args, c = config.model_args, config
    a = _bytes(c.activation_dtype, "compute_dtype")
    layout = _chunk_layout(c.schedule, c.pp, c.shape.stages_per_rank, args.n_layers)
    tokens = [length * c.microbatch_size for length in c.shape.lengths]
    is_sequence = c.schedule in SEQUENCE_SCHEDULES
    rates = _state_rates(c)
    received = c.shape.microbatches / layout.copies * sum(c.shape.lengths)  # tokens a chain's stage receives
    weights = [_stage_bytes(args, c, a, chunk, tokens, is_sequence) for chunk in layout.chunks]
    params = np.array([chunk_parameters(args, *chunk, c.tp) for chunk in layout.chunks])
    workspace = np.array([_workspace_per_token(args, c, a, chunk, is_sequence) for chunk in layout.chunks])
    buffers = np.array([_buffer_bytes_per_token(args, c, a, chunk) for chunk in layout.chunks]) * received
    microbatch = np.array([sum(w.saved) + w.held + w.slab + w.constant for w in weights])

    base = (
        layout.count @ params * (rates.parameters + rates.gradients)
        + layout.primary @ params * rates.optimizer
        + np.max(np.where(layout.count > 0, workspace, 0.0), axis=1) * max(tokens) / c.cp
        + layout.count @ buffers
    )
    floor = base + (layout.per_chain @ microbatch).max(axis=1)  # (ranks,)
    if walked:
        shape = c.shape
        plan = _plan(
            c.schedule, c.pp, shape.microbatches, shape.num_subsequences, shape.stages_per_rank, c.split_backward
        )
        live, holding = plan.fullest(shape.num_subsequences, args.n_layers)  # (ranks, kinds, k), (ranks, kinds)
        saved, constant = np.array([w.saved for w in weights]), np.array([w.constant for w in weights])
        units = np.einsum("rtj,tj->r", live, saved) + holding @ constant
        scale = np.where(plan.forwards_first, shape.microbatches / plan.built_microbatches, 1.0)
        floor = np.maximum(floor, base + units * scale)
    # The estimate rounds five sums of the fullest rank to bytes: 3 bytes below, the floor is below it.
    return float(floor.max()) - 3


class _ChunkLayout(NamedTuple):
    """Which model chunks each rank's stages run, counted per kind of chunk (a chunk's layers and ends)."""

    chunks: list[tuple[float, bool, bool]]
    """The kinds of chunk."""
    count: np.ndarray
    """(ranks, kinds): the rank's stages of each kind."""
    primary: np.ndarray
    """(ranks, kinds): those of chain A (the copies that hold optimizer states)."""
    per_chain: np.ndarray
    """(ranks, chains, kinds): the rank's stages of each kind per chain."""
    copies: int


@functools.lru_cache(maxsize=256)
def _chunk_layout(schedule: str, pp: int, stages_per_rank: int | None, n_layers: int) -> _ChunkLayout:
    """:func:`memory_floor`'s view of where a schedule places its stages (:func:`~.build.stages_by_rank`)."""
    copies = getattr(SEQUENCE_SCHEDULES.get(schedule), "parameter_copies", 1)
    by_rank = stages_by_rank(schedule, pp, stages_per_rank)
    chain_length = pp * len(by_rank[0]) // copies
    chunks, kind = _chunk_kinds(n_layers, chain_length)
    per_chain = np.zeros((pp, copies, len(chunks)))
    for r, stages in enumerate(by_rank):
        for s in stages:
            per_chain[r, s // chain_length, kind[s % chain_length]] += 1
    return _ChunkLayout(chunks, per_chain.sum(axis=1), per_chain[:, 0], per_chain, copies)


@functools.lru_cache(maxsize=256)
def _chunk_kinds(n_layers: int, chain_length: int) -> tuple[list[tuple[float, bool, bool]], list[int]]:
    """The kinds of chunk of a chain (a chunk's layers and ends, sorted) and, per chain position, its kind."""
    of_position = _chunk_split(n_layers, chain_length)
    chunks = sorted(set(of_position))
    return chunks, [chunks.index(chunk) for chunk in of_position]


# --------------------------------------------------------------------------
# The schedule: each rank's actions, built once per shape


@dataclass(frozen=True)
class _Plan:
    """A schedule's per-rank compute actions at ``built_microbatches`` (see ``_plan``)."""

    order: dict[int, tuple]
    chain_length: int
    parameter_copies: int
    built_microbatches: int
    events: dict[tuple[int, int], _Events] = field(default_factory=dict, compare=False, repr=False)
    """:func:`_events` per (rank, k), filled as :meth:`events_of` is asked for them."""
    merged: dict[int, tuple[_Events, np.ndarray]] = field(default_factory=dict, compare=False, repr=False)
    """Per k, every rank's events end to end, and where each rank's begin (see :meth:`merged_events`)."""
    arenas: dict[tuple[tuple[int, ...], bool], np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    """Per subsequence lengths and ``with_own``, :func:`_arena_events` of every rank end to end (see
    :meth:`merged_arenas`)."""
    passes: dict[tuple[int, int], list[tuple[list[int], tuple[Pass, ...]]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per (rank, k), each of its stages' passes where the rank runs them (see :meth:`passes_of`)."""
    forwards: dict[tuple[int, int], dict[int, list[int]]] = field(default_factory=dict, compare=False, repr=False)
    """Per (rank, k), per stage of the rank, its forwards of each unit (see :meth:`forwards_of`)."""
    live: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, compare=False, repr=False)
    """Per (k, layers), the units each rank holds where it holds the most (see :meth:`fullest`)."""
    by_rank: dict[int, list[int]] = field(init=False, compare=False, repr=False)
    """Per rank, its stages, sorted."""
    forwards_first: np.ndarray = field(init=False, compare=False, repr=False)
    """Per rank, whether it runs every forward first (GPipe, TeraPipe): its peak grows with N, so
    :func:`_walks` scales it by N / built_microbatches."""

    def __post_init__(self) -> None:
        by_rank = {r: sorted({a.stage_index for a in acts}) for r, acts in self.order.items()}
        object.__setattr__(self, "by_rank", by_rank)
        first = np.array([_all_forwards_first(self.order[r]) for r in sorted(self.order)])
        object.__setattr__(self, "forwards_first", first)

    @property
    def stages(self) -> set[int]:
        return {s for stages in self.by_rank.values() for s in stages}

    def stages_of(self, rank: int) -> list[int]:
        return self.by_rank[rank]

    def events_of(self, rank: int, k: int) -> _Events:
        """``rank``'s :func:`_events` with k subsequences, built once."""
        if (rank, k) not in self.events:
            self.events[rank, k] = _events(self.order[rank], k)
        return self.events[rank, k]

    def forwards_of(self, rank: int, k: int) -> dict[int, list[int]]:
        """Per stage of ``rank``, how many forwards of each unit j it runs with k subsequences, counted
        once: the receive buffers of every cut with k units and every rank count them (:func:`_buffers`)."""
        if (rank, k) not in self.forwards:
            e = self.events_of(rank, k)
            self.forwards[rank, k] = {
                s: np.bincount(e.unit[(e.stage == s) & (e.saved == 1)], minlength=k).tolist()
                for s in self.stages_of(rank)
            }
        return self.forwards[rank, k]

    def fullest(self, k: int, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """Where each rank holds the most units (its saved activations' events counted, bytes aside),
        per kind of chunk (a chunk's layers and ends, in :func:`_chunk_kinds`'s order): per rank, kind
        and unit j the units held, and per rank and kind the stages holding any; found once per k."""
        if (k, n_layers) not in self.live:
            chunks, kind = _chunk_kinds(n_layers, self.chain_length)
            kinds = [kind[s % self.chain_length] for s in range(len(self.stages))]
            units, holding = np.zeros((len(self.order), len(chunks), k)), np.zeros((len(self.order), len(chunks)))
            for r in sorted(self.order):
                e = self.events_of(r, k)
                until = int(np.argmax(np.cumsum(e.saved))) + 1
                live = np.zeros((len(self.stages), k))
                np.add.at(live, (e.stage[:until], e.unit[:until]), e.saved[:until])
                np.add.at(units[r], kinds, live)
                np.add.at(holding[r], kinds, live.sum(axis=1) > 0)
            self.live[k, n_layers] = units, holding
        return self.live[k, n_layers]

    def merged_events(self, k: int) -> tuple[_Events, np.ndarray]:
        """Every rank's :func:`_events` end to end, ranks ascending, and each rank's first index."""
        if k not in self.merged:
            parts = [self.events_of(r, k) for r in sorted(self.order)]
            starts = np.cumsum([0] + [len(e.stage) for e in parts[:-1]])
            self.merged[k] = (_Events(*(np.concatenate(f) for f in zip(*parts))), starts)
        return self.merged[k]

    def passes_of(self, rank: int, k: int) -> list[tuple[list[int], tuple[Pass, ...]]]:
        """Per stage of ``rank``, :func:`~torchtitan_seq.ordering.stage_passes` with k subsequences,
        found once: every cut of the sequence with k units walks the same passes."""
        if (rank, k) not in self.passes:
            actions = self.order[rank]
            found = (stage_passes(actions, stage, k) for stage in {a.stage_index for a in actions})
            self.passes[rank, k] = [(where, tuple(passes)) for where, passes in found]
        return self.passes[rank, k]

    def merged_arenas(self, lengths: tuple[int, ...], with_own: bool) -> np.ndarray:
        """Every rank's :func:`_arena_events` end to end, ranks ascending, as :meth:`merged_events`."""
        if (lengths, with_own) not in self.arenas:
            k = len(lengths)
            parts = [
                _arena_events(len(self.order[r]), self.passes_of(r, k), lengths, with_own) for r in sorted(self.order)
            ]
            self.arenas[lengths, with_own] = np.concatenate(parts)
        return self.arenas[lengths, with_own]


@functools.lru_cache(maxsize=256)
def _plan(schedule: str, p: int, n: int, k: int, v: int | None, split_backward: bool) -> _Plan:
    """Compute-only lists of ``schedule`` for min(n, 2p + n mod p) microbatches, cached."""
    built_n = n if n <= 2 * p else 2 * p + n % p
    built = build(SimConfig(schedule, p, built_n, k, stages_per_rank=v, split_backward=split_backward))
    order = {
        r: tuple(leaf for act in acts if act is not None for leaf in compute_leaves(act))
        for r, acts in built.order.items()
    }
    num_stages = p * built.stages_per_rank
    return _Plan(order, num_stages // built.parameter_copies, built.parameter_copies, built_n)


class _StageBytes(NamedTuple):
    """What a stage's units and microbatches weigh (bytes)."""

    saved: list[float]
    """Per unit j, saved activations from the unit's forward to its backward, the slab apart."""
    slab: float = 0.0
    """A microbatch's K/V slab where autograd saves it (layers not recomputed)."""
    held: float = 0.0
    """A microbatch's K/V slab where the context alone keeps it (recomputed layers)."""
    grad: float = 0.0
    """A microbatch's slab gradient."""
    constant: float = 0.0
    """Saved once while any unit of the stage is (the RoPE table)."""


def _stage_bytes(
    args: TransformerModelArgs,
    c: MemoryConfig,
    a: int,
    chunk: tuple[float, bool, bool],
    tokens: list[int],
    is_sequence: bool,
) -> _StageBytes:
    """What units of ``tokens`` tokens weigh on a stage running ``chunk`` (under CP a rank computes 1/c of
    each unit's tokens and its slab holds the whole sequence's K/V, the last unit's too)."""
    layers, first, last = chunk
    per_token = _saved_per_token(args, c, a, layers, first, last, is_sequence)
    recomputed = _recomputed_fraction(c)
    # The whole RoPE table (complex64, seq_len x hd / 2) is saved once per stage where layers
    # get it whole: torch's schedules slice it, checkpointed blocks take it as an input.
    table = 4 * c.seq_len * (args.dim // args.n_heads) if layers and (not is_sequence or recomputed) else 0
    if not is_sequence:  # torch's schedules: K/V are the unit's own, no context
        return _StageBytes([n * per_token for n in tokens], constant=table)
    kv = 2 * _kv_width(args) / c.tp * a * layers  # K and V, a token
    slab = (sum(tokens) - (tokens[-1] if c.cp == 1 else 0)) * kv  # the keys later units (or CP ranks) read
    saved_kv = kv * (1 - recomputed)  # in the per-token bytes: where the slab holds them, its views
    own = [n / c.cp * (per_token - saved_kv) for n in tokens]  # K/V in the slab: units 0..k-2, all under CP
    return _StageBytes(
        own[:-1] + [tokens[-1] * per_token if c.cp == 1 else own[-1]],
        slab * (1 - recomputed),
        slab * recomputed,
        slab,
        table,
    )


class _Events(NamedTuple):
    """A rank's actions as indices into stage byte tables (see :func:`_walks`), one entry per action."""

    stage: np.ndarray
    unit: np.ndarray
    saved: np.ndarray
    """+1: the unit's activations are saved (F); -1: freed (B, or W)."""
    constant: np.ndarray
    """+1 / -1: the stage's first unit in flight starts / its last ends."""
    grad: np.ndarray
    """+1 / -1: a microbatch's slab gradient is allocated (its first B or I of a unit j > 0) / goes."""


def _events(actions: tuple, k: int) -> _Events:
    """The bookkeeping of :func:`_walks`, independent of bytes (see the module docstring)."""
    live: dict[int, int] = {}  # units in flight per stage
    grads: set[tuple[int, int]] = set()  # (stage, microbatch) with a slab gradient
    rows = []
    for a in actions:
        stage, kind = a.stage_index, a.computation_type
        m, j = divmod(a.microbatch_index, k)
        saved = constant = grad = 0
        if kind == F:
            saved, constant = 1, int(live.get(stage, 0) == 0)
            live[stage] = live.get(stage, 0) + 1
        else:
            if kind in (B, I) and j > 0 and (stage, m) not in grads:
                grads.add((stage, m))
                grad = 1
            if kind == B or kind == W:
                live[stage] -= 1
                saved, constant = -1, -int(live[stage] == 0)
                if j == 0 and (stage, m) in grads:
                    grads.discard((stage, m))
                    grad = -1
        rows.append((stage, j, saved, constant, grad))
    table = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return _Events(*(table[:, i] for i in range(5)))


def _arena_events(
    count: int, stages: list[tuple[list[int], tuple[Pass, ...]]], lengths: tuple[int, ...], with_own: bool = False
) -> np.ndarray:
    """Per action of a rank (``count`` of them), the K/V arenas that the KV context allocates (+) or
    lets go (-) there, in slabs (a slab: the keys later units read; ``with_own``, under CP, the last
    unit's too): each stage's arenas as it plans them (:func:`~torchtitan_seq.kv_placement.plan_arenas`)
    from its passes (``stages``: where the rank runs each, and the passes), from a write into an empty
    one to the end of the last backward of a slab in it."""
    size = sum(lengths[: None if with_own else -1])
    deltas = np.zeros(count)
    for where, passes in stages if size else ():
        arenas = plan_arenas(passes, lengths, size)
        for start, end in arenas.busy:
            deltas[where[start]] += arenas.capacity / size
            deltas[where[end]] -= arenas.capacity / size
    return deltas


def _walks(
    plan: _Plan, weights: dict[int, _StageBytes], lengths: tuple[int, ...], n: int, with_own: bool = False
) -> list[tuple[float, float]]:
    """Per rank, (peak of saved activations, peak of activations + KV context) over its actions
    (bookkeeping in :func:`_events` and :func:`_arena_events`, built once per plan and lengths; all
    ranks in one pass); ``with_own``: slabs hold the last unit's K/V too (CP)."""
    k = len(lengths)
    e, starts = plan.merged_events(k)
    arenas = plan.merged_arenas(lengths, with_own)
    stages = np.array(list(weights))
    saved = np.zeros((stages.max() + 1, k))
    slab, held, grad, constant = (np.zeros(stages.max() + 1) for _ in range(4))
    saved[stages] = [w.saved for w in weights.values()]
    for table, name in ((slab, "slab"), (held, "held"), (grad, "grad"), (constant, "constant")):
        table[stages] = [getattr(w, name) for w in weights.values()]
    act = e.saved * saved[e.stage, e.unit] + arenas * slab[e.stage] + e.constant * constant[e.stage]
    kv = arenas * held[e.stage] + e.grad * grad[e.stage]
    peaks = []
    for deltas in (act, act + kv):
        running = np.cumsum(deltas)
        before = np.concatenate(([0.0], running))[starts]  # the running sum as each rank begins
        peaks.append(np.maximum(np.maximum.reduceat(running, starts) - before, 0.0))
    scale = np.where(plan.forwards_first, n / plan.built_microbatches, 1.0)
    return [(float(a), float(b)) for a, b in zip(peaks[0] * scale, peaks[1] * scale)]


def _all_forwards_first(actions: tuple) -> bool:
    """Whether the rank runs every forward before its first backward (GPipe, TeraPipe)."""
    kinds = [a.computation_type for a in actions]
    last_forward = max(i for i, kind in enumerate(kinds) if kind == F)
    return all(kind == F for kind in kinds[: last_forward + 1])


# --------------------------------------------------------------------------
# The model: chunks and bytes per token


def _bytes(dtype: str, name: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{name} = {dtype!r}: use one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _kv_width(args: TransformerModelArgs) -> int:
    """Hkv hd: K (or V) values per token and layer."""
    return (args.n_kv_heads or args.n_heads) * (args.dim // args.n_heads)


@functools.lru_cache(maxsize=256)
def _chunk_split(n_layers: int, num_chunks: int) -> tuple[tuple[float, bool, bool], ...]:
    """Per chunk: (transformer layers, holds the embeddings, holds norm + output), as torchtitan cuts it."""
    split = chunk_split(n_layers, num_chunks)
    if split is None:  # more chunks than layers: an even real-valued share
        share = n_layers / num_chunks
        return tuple((share, i == 0, i == num_chunks - 1) for i in range(num_chunks))
    return split


def _recomputed_fraction(c: MemoryConfig) -> float:
    """Share of layers whose forward is recomputed in backward (their K/V kept by the context)."""
    if c.activation_checkpoint == "none":
        return 0.0
    if c.activation_checkpoint == "selective" and c.selective_ac_option != "op":
        return 1 / int(c.selective_ac_option)
    return 1.0


def _layer_bytes(args: TransformerModelArgs, c: MemoryConfig, a: int, mode: str, unit: bool) -> float:
    """Saved bytes per token of one transformer layer, ``mode`` 'none', 'full' or 'op'."""
    d, t, f = args.dim, c.tp, ffn_hidden_dim(args)
    kv = _kv_width(args)
    if mode == "full":
        return a * d / t
    if mode == "op":
        return a * (2 * d + kv + f) / t + a * d + (a * d / t if t > 1 else 0)
    norms = 2 * _norm_bytes(args, c, a)  # attention_norm's input x, ffn_norm's h
    gathered = 2 * a * d  # the attention and MLP projections' input, whole tokens under TP
    body = a * (2 * d + 2 * kv + 4 * f) / t  # q, attention output, K, V; w1, w3, SiLU, product
    lse = 4 * args.n_heads / t
    rope = 4 * (d // args.n_heads) if unit else 0  # the unit's RoPE rows, complex64
    return norms + gathered + body + lse + rope


def _norm_bytes(args: TransformerModelArgs, c: MemoryConfig, a: int) -> float:
    """What one RMSNorm saves per token: on CUDA torch's fused kernel keeps its input and
    1/rms (float32); on the CPU the composite form keeps the input upcast to float32,
    1/rms and x/rms, all float32."""
    d, t = args.dim, c.tp
    return (a * d / t if c.device == "cuda" else 8 * d / t) + 4 / t


def _saved_per_token(
    args: TransformerModelArgs, c: MemoryConfig, a: int, layers: float, first: bool, last: bool, unit: bool
) -> float:
    """Saved bytes per token of a unit on a chunk of ``layers`` layers (see the module docstring)."""
    mode = c.activation_checkpoint
    if mode == "none":
        per_layer = _layer_bytes(args, c, a, "none", unit)
    elif mode == "full" or c.selective_ac_option == "op":
        per_layer = _layer_bytes(args, c, a, "full" if mode == "full" else "op", unit)
    else:
        n = int(c.selective_ac_option)
        per_layer = (_layer_bytes(args, c, a, "full", unit) + (n - 1) * _layer_bytes(args, c, a, "none", unit)) / n
    out = layers * per_layer
    if unit and mode != "none" and layers:
        out += 8  # positions, a checkpoint input
    if first:
        out += 8  # token ids
    if last:
        out += _norm_bytes(args, c, a) + a * args.dim + 4 * args.vocab_size / c.tp + 8
    return out


# --------------------------------------------------------------------------
# Parameters, gradients, optimizer, workspace, buffers


class _StateRates(NamedTuple):
    """Bytes a rank holds per parameter of a stage it holds."""

    parameters: float
    gradients: float
    optimizer: float
    """Per parameter of chain A's copy only (see the module docstring)."""


def _state_rates(c: MemoryConfig) -> _StateRates:
    master, compute = _bytes(c.param_dtype, "param_dtype"), _bytes(c.activation_dtype, "compute_dtype")
    if c.fsdp:
        # Under PP torchtitan keeps the unsharded copy through the step and the schedule
        # reduce-scatters after the last backward; without PP each layer reshards after use
        # and every backward reduce-scatters.
        pipelined = c.pp > 1
        per_param = master / c.fsdp_degree + (compute if pipelined else 0)
        grad = _bytes(c.mixed_precision_reduce, "mixed_precision_reduce")
        grad_per_param = grad if pipelined else grad / c.fsdp_degree
    else:
        per_param = master + (compute if compute != master else 0)
        grad_per_param = master
    optimizer = c.optimizer_states * _bytes(c.optimizer_dtype, "optimizer_dtype") / c.fsdp_degree
    return _StateRates(per_param, grad_per_param, optimizer)


def _state_bytes(args: TransformerModelArgs, c: MemoryConfig, plan: _Plan, chunks, rank: int) -> dict[str, int]:
    held = [chunk_parameters(args, *chunks[s % plan.chain_length], c.tp) for s in plan.stages_of(rank)]
    primary = [
        chunk_parameters(args, *chunks[s % plan.chain_length], c.tp)
        for s in plan.stages_of(rank)
        if s < plan.chain_length
    ]
    rates = _state_rates(c)
    return {
        "parameters": round(sum(held) * rates.parameters),
        "gradients": round(sum(held) * rates.gradients),
        "optimizer": round(sum(primary) * rates.optimizer),
    }


def _workspace_per_token(
    args: TransformerModelArgs, c: MemoryConfig, a: int, chunk: tuple[float, bool, bool], unit: bool
) -> float:
    """The largest transient of a pass on a stage running ``chunk``, per token of its longest unit."""
    d, t, f, kv = args.dim, c.tp, ffn_hidden_dim(args), _kv_width(args)
    layers, _, last = chunk
    per_token = a * (2 * f + 2 * d + 2 * kv) / t if layers else 0.0
    if unit and c.shape.num_subsequences > 1 and layers:
        per_token += 8 * d / t
    if last:
        per_token = max(per_token, (8 + a) * args.vocab_size / t)
    return per_token


def _workspace(
    args: TransformerModelArgs, c: MemoryConfig, a: int, plan: _Plan, chunks, rank: int, longest: int, unit: bool
) -> float:
    chunks_held = (chunks[s % plan.chain_length] for s in plan.stages_of(rank))
    return max(_workspace_per_token(args, c, a, chunk, unit) for chunk in chunks_held) * longest


def _buffers(
    args: TransformerModelArgs, c: MemoryConfig, a: int, plan: _Plan, chunks, rank: int, lengths: list[int]
) -> float:
    scale = c.shape.microbatches / plan.built_microbatches
    forwards = plan.forwards_of(rank, len(lengths))
    total = 0.0
    for s in plan.stages_of(rank):
        tokens = float(sum(count * length for count, length in zip(forwards[s], lengths)))
        total += tokens * scale * _buffer_bytes_per_token(args, c, a, chunks[s % plan.chain_length])
    return total


def _buffer_bytes_per_token(
    args: TransformerModelArgs, c: MemoryConfig, a: int, chunk: tuple[float, bool, bool]
) -> float:
    """Receive buffers of a stage running ``chunk``, per token of the units it runs: activations in
    but into a chain's first stage, gradients in but into its last."""
    _, first, last = chunk
    return ((not first) + (not last)) * c.microbatch_size * a * args.dim / (c.tp * c.cp)
