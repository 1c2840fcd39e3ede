"""Sequence-level pipeline schedules.

Each schedule is a short pure function ``(num_ranks, num_microbatches,
num_subsequences) -> {rank: [compute actions]}`` over (microbatch, subsequence)
units, numbered ``unit id = m * k + j`` (a multi-stage schedule's also takes
``stages_per_rank``), plus a thin
``_PipelineScheduleRuntime`` subclass that validates the lists
(:mod:`torchtitan_seq.ordering`) and hands them to torch's own lowering
(send/recv, FSDP unshard/reshard, gradient reduction) and executor.

Usage with plain ``torch.distributed.pipelining``::

    lengths = partition_sequence(seq_len, 4, "even")
    stage = SequencePipelineStage(chunk, rank, world, device, lengths=lengths)
    schedule = ScheduleSeq1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    losses = []
    schedule.step(tokens, target=labels, losses=losses)  # tokens: (batch, seq_len)

``loss_fn(output, target)`` receives one unit and must return that unit's
share of the step's loss: the *sum* of its token losses divided by the
step's token count (see :class:`torchtitan_seq.loss.TokenNormalizedLoss`), so
that summing units is exact for uneven subsequences. ``losses`` receives one
loss per microbatch, as with torch's schedules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

from .bidirectional import BidirectionalLayout, MirroredCopies, lower_chains
from .ordering import B, F, I, W, validate_unit_order
from .stage import SequencePipelineStage

__all__ = [
    "seq1f1b_actions",
    "terapipe_actions",
    "interleaved_seq1f1b_actions",
    "bsipipe_actions",
    "SequenceSchedule",
    "ScheduleSeq1F1B",
    "ScheduleTeraPipe",
    "ScheduleInterleavedSeq1F1B",
    "ScheduleBSIPipe",
    "SEQUENCE_SCHEDULES",
]

ActionLists = dict[int, list[_Action | None]]


Slot = tuple[int, int]
"""(stage index, unit id): one unit on one stage."""


def _unit_orders(microbatches: range, k: int) -> tuple[list[int], list[int]]:
    """Units of ``microbatches`` in forward order (subsequence order) and in backward
    order (last subsequence first)."""
    fwd = [m * k + j for m in microbatches for j in range(k)]
    bwd = [m * k + j for m in microbatches for j in reversed(range(k))]
    return fwd, bwd


def _one_f_one_b(warmup: int, fwd: list[Slot], bwd: list[Slot], split_backward: bool) -> list[_Action | None]:
    """One rank's list: ``warmup`` forwards, then alternate backward/forward, then the remaining backwards.

    ``fwd`` and ``bwd`` are the rank's slots in the order they run forward and
    backward. With ``split_backward`` each backward is an input-gradient pass
    (I) followed by its weight-gradient pass (W), except in the cool-down,
    where the Ws wait until every I has run: the I passes the previous rank is
    waiting for go first, and the Ws fill what would be idle time at the end
    (the zero-bubble idea), without holding more activations than 1F1B.
    """
    back = I if split_backward else B
    actions: list[_Action | None] = [_Action(s, F, u) for s, u in fwd[:warmup]]
    for (s_f, u_f), (s_b, u_b) in zip(fwd[warmup:], bwd):
        actions.append(_Action(s_b, back, u_b))
        if split_backward:
            actions.append(_Action(s_b, W, u_b))
        actions.append(_Action(s_f, F, u_f))
    cooldown = bwd[len(fwd) - warmup:]
    actions += [_Action(s, back, u) for s, u in cooldown]
    if split_backward:
        actions += [_Action(s, W, u) for s, u in cooldown]
    return actions


def _single_stage(
    num_ranks: int, num_microbatches: int, k: int, warmup: Callable[[int], int], split_backward: bool
) -> ActionLists:
    """Stage r on rank r, all units in order; ``warmup(r)`` forwards before rank r's first backward."""
    fwd, bwd = _unit_orders(range(num_microbatches), k)
    actions: ActionLists = {}
    for r in range(num_ranks):
        slots = [(r, u) for u in fwd], [(r, u) for u in bwd]
        actions[r] = _one_f_one_b(min(len(fwd), warmup(r)), *slots, split_backward)
    return actions


def seq1f1b_actions(
    num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False
) -> ActionLists:
    """Seq1F1B (arXiv 2406.03488): 1F1B over units, one stage per rank.

    Rank r warms up with k + p - 1 - r forwards, so the first backward (the
    last subsequence of microbatch 0) arrives just as it is needed; then one
    backward and one forward alternate. Peak in-flight units on rank 0:
    min(p - 1 + k, N k).
    """
    k = num_subsequences
    return _single_stage(num_ranks, num_microbatches, k, lambda r: k + num_ranks - 1 - r, split_backward)


def terapipe_actions(
    num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False
) -> ActionLists:
    """TeraPipe (ICML'21): GPipe over units, every forward then every backward, last unit first."""
    n = num_microbatches * num_subsequences
    return _single_stage(num_ranks, num_microbatches, num_subsequences, lambda r: n, split_backward)


def _rounds(num_ranks: int, num_microbatches: int, k: int) -> list[range]:
    """The microbatches of each round of the interleaved schedule.

    Rounds hold p microbatches. A remainder of N mod p microbatches is a
    final, shorter round when it holds at least p units, enough to keep
    the pipeline busy while the ranks pass a round's units down their chunks;
    a smaller one would stall the pipeline (for k = 1 it can even deadlock
    torch's send/recv lowering), so it is spread over the earlier rounds, one
    extra microbatch each, first rounds first (torch's Interleaved1F1B likewise
    makes N // p rounds, but only when they come out equal). The first round is
    always the largest: the warm-up is sized by it.
    """
    p, n = num_ranks, num_microbatches
    full, rest = divmod(n, p)
    if full == 0 or rest * k >= p:
        sizes = [p] * full + ([rest] if rest else [])
    else:
        sizes = [n // full + (i < n % full) for i in range(full)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(s, s + size) for s, size in zip(starts, sizes)]


def interleaved_seq1f1b_actions(
    num_ranks: int,
    num_microbatches: int,
    num_subsequences: int,
    *,
    split_backward: bool = False,
    stages_per_rank: int = 2,
) -> ActionLists:
    """Seq1F1B-I: interleaved 1F1B over units, v = ``stages_per_rank`` chunks per rank.

    Loop placement: rank r holds stages r, r + p, ..., r + (v - 1) p. Work
    rotates over the chunks in rounds of p microbatches (p k units, see
    :func:`_rounds`): forward runs a round's units through chunk 0, then chunk
    1, ..., backward through chunk v - 1 down to chunk 0, last subsequence
    first. The released Seq1F1B-I rotates in rounds of p *units*, which
    deadlocks or breaks the backward order unless k divides p.

    Rank r warms up with (v - 1) R k + k + 2 (p - 1 - r) forwards (R: the
    first round's microbatches): up to its forward of the last chunk's first
    backward unit (microbatch 0, subsequence k - 1), plus the time that unit
    takes to reach the last rank and its backward to come back. Peak in-flight
    units on rank 0: that warm-up, at most v N k. Bubble ratio under uniform
    costs: (p - 1) / (v N k + p - 1) when p divides N.
    """
    p, k, v = num_ranks, num_subsequences, stages_per_rank
    rounds = _rounds(p, num_microbatches, k)
    orders = [_unit_orders(mbs, k) for mbs in rounds]
    actions: ActionLists = {}
    for r in range(p):
        fwd = [(c * p + r, u) for f, _ in orders for c in range(v) for u in f]
        bwd = [(c * p + r, u) for _, b in orders for c in reversed(range(v)) for u in b]
        warmup = (v - 1) * len(rounds[0]) * k + 2 * (p - 1 - r) + k
        actions[r] = _one_f_one_b(min(len(fwd), warmup), fwd, bwd, split_backward)
    return actions


_BSIPIPE_PRIORITIES = (
    (0.054, -0.249, -0.969, 0.466, 0.653),
    (0.282, -0.09, -0.819, 0.619, 1.08),
    (0.44, 0.63, -0.946, 0.056, 1.936),
    (0.116, 1.888, -0.523, 0.409, -0.229),
    (0.345, 1.655, -0.92, -0.521, 1.964),
)
"""Weights of BSIPipe's list-scheduling priorities (see :func:`_list_schedule`),
found by a random search over uniform-cost simulations (p 4 and 8, k 1-4,
N 2p and 8p); no single one is best for every shape."""


@dataclass
class _ListSchedule:
    actions: ActionLists
    makespan: float
    in_flight: list[list[int]]
    """Per position: the most units of chain A, of chain B and of both held at
    once (a unit on one chunk counts one)."""

    @property
    def peak(self) -> int:
        return max(most[2] for most in self.in_flight)


def _list_schedule(
    num_ranks: int, num_microbatches: int, k: int, weights: tuple[float, ...], limits: list[list[int]]
) -> _ListSchedule:
    """One BSIPipe list schedule under uniform costs (a chunk's forward 1/2k, its backward 1/k).

    Whenever a position can start something, it runs the pass with the lowest
    priority among those whose inputs exist: weights . (is a forward, passes it
    ran on that chain / 10, +-depth in the chain / 10 (+ for forwards),
    microbatch / 10, time it spent on that chain). A forward waits while the
    position holds ``limits[q][chain]`` units of that chain or ``limits[q][2]``
    in all; if no position can start anything under the limits, they grow by one.
    """
    p, chain = num_ranks, 2 * num_ranks
    layout = BidirectionalLayout(p, placement="linear")
    fwd: dict[int, list[int]] = {}
    bwd: dict[int, list[int]] = {}
    for c in (0, 1):
        f, b = _unit_orders(range(c, num_microbatches, 2), k)
        for s in range(chain):
            fwd[c * chain + s], bwd[c * chain + s] = f[::-1], b[::-1]
    cost = {F: 0.5 / k, B: 1.0 / k}
    finished: dict[tuple[int, Any, int], float] = {}
    free = [0.0] * p
    live = [[0, 0] for _ in range(p)]
    most = [[0, 0, 0] for _ in range(p)]
    ran = [[0, 0] for _ in range(p)]
    busy = [[0.0, 0.0] for _ in range(p)]
    limits = [list(lim) for lim in limits]
    stages = [layout.stages_of_rank(q) for q in range(p)]
    actions: ActionLists = {q: [] for q in range(p)}

    def candidates(q: int) -> list[tuple[float, float, int, Any, int]]:
        out = []
        for s in stages[q]:
            c, depth = divmod(s, chain)
            for kind, queue in ((B, bwd[s]), (F, fwd[s])):
                full = live[q][c] >= limits[q][c] or sum(live[q]) >= limits[q][2]
                if not queue or (kind == F and full):
                    continue
                u = queue[-1]
                if kind == F:
                    needs = [(s - 1, F, u)] if depth else []
                else:
                    needs = [(s, F, u - u % k + k - 1)] + ([(s + 1, B, u)] if depth < chain - 1 else [])
                if all(n in finished for n in needs):
                    w = weights
                    priority = (
                        w[0] * (kind == F) + w[1] * ran[q][c] * 0.1
                        + w[2] * depth * (0.1 if kind == F else -0.1) + w[3] * (u // k) * 0.1 + w[4] * busy[q][c]
                    )
                    out.append((max([free[q]] + [finished[n] for n in needs]), priority, s, kind, u))
        return out

    # Each position's candidates change only when it or a neighbour in a chain acts.
    touches = {s: {layout.rank_of_stage(n) for n in (s - 1, s, s + 1) if n // chain == s // chain}
               for s in range(2 * chain)}
    cached = {q: candidates(q) for q in range(p)}
    remaining = 2 * num_microbatches * k * chain
    while remaining:
        # The position that can start soonest acts; nothing it waits for can finish earlier.
        options = [(min(c[0] for c in cands), q, cands) for q, cands in cached.items() if cands]
        if not options:
            limits = [[lim + 1 for lim in lims] for lims in limits]
            cached = {q: candidates(q) for q in range(p)}
            continue
        start, q, cands = min(options, key=lambda o: o[:2])
        _, _, s, kind, u = min((c for c in cands if c[0] <= start), key=lambda c: c[1])
        c = s // chain
        (fwd if kind == F else bwd)[s].pop()
        live[q][c] += 1 if kind == F else -1
        most[q][c] = max(most[q][c], live[q][c])
        most[q][2] = max(most[q][2], sum(live[q]))
        ran[q][c] += 1
        busy[q][c] += cost[kind]
        free[q] = finished[(s, kind, u)] = start + cost[kind]
        actions[q].append(_Action(s, kind, u))
        remaining -= 1
        for r in touches[s]:
            cached[r] = candidates(r)
    return _ListSchedule(actions, max(free), most)


def _check_bsipipe_shape(
    num_ranks: int, num_microbatches: int, split_backward: bool, stages_per_rank: int = 4
) -> None:
    """Raise, naming the setting, for a shape BSIPipe cannot run."""
    if stages_per_rank != 4:
        raise ValueError(f"BSIPipe holds 4 stages per rank (2 chunks of each chain), not {stages_per_rank}")
    if split_backward:
        raise ValueError("BSIPipe runs full backwards: set sequence_pipeline.split_backward = false")
    if num_microbatches % 2:
        raise ValueError(
            f"BSIPipe shares the microbatches between its two pipelines, so it needs an even "
            f"number of them, got {num_microbatches}: change training.local_batch_size or "
            "parallelism.pipeline_parallel_microbatch_size"
        )
    BidirectionalLayout(num_ranks)  # an even p


def bsipipe_actions(
    num_ranks: int,
    num_microbatches: int,
    num_subsequences: int,
    *,
    split_backward: bool = False,
    stages_per_rank: int = 4,
) -> ActionLists:
    """BSIPipe: two V-shaped pipelines in opposite directions over units.

    Stages are numbered as :class:`~torchtitan_seq.bidirectional.BidirectionalLayout`
    numbers them (chain A: 0..2p-1, chain B: 2p..4p-1) and the lists are keyed
    by pipeline position (the schedule maps positions to ranks). Even
    microbatches go down chain A, odd ones down chain B.

    Basic-unit concatenation: a basic unit of 2p microbatches (p each way) is
    list-scheduled under each of :data:`_BSIPIPE_PRIORITIES`, with at most
    3k + 2p units of a chain held on a position, and the shortest one kept.
    The units each position and chain held at most there are the memory
    budget of the whole step: the step is list-scheduled again under each
    priority within that budget, and the shortest that uses all of it is
    kept (else the shortest). So peak activations do not grow with N.

    Full backward only: torch's input/weight split special-cases stage 0,
    which would miss chain B's first stage.
    """
    _check_bsipipe_shape(num_ranks, num_microbatches, split_backward, stages_per_rank)
    p, k = num_ranks, num_subsequences
    limit = [[3 * k + 2 * p] * 2 + [6 * k + 4 * p] for _ in range(p)]
    basic_n = min(num_microbatches, 2 * p)
    basic = min(
        (_list_schedule(p, basic_n, k, w, limit) for w in _BSIPIPE_PRIORITIES), key=lambda r: r.makespan
    )
    if num_microbatches == basic_n:
        return basic.actions
    steps = [_list_schedule(p, num_microbatches, k, w, basic.in_flight) for w in _BSIPIPE_PRIORITIES]
    return min(steps, key=lambda r: (r.peak != basic.peak, r.makespan)).actions


class SequenceSchedule(_PipelineScheduleRuntime):
    """Base of the sequence schedules: runs N microbatches as N k units.

    Args:
        stages: this rank's :class:`SequencePipelineStage`, or a list of them:
            one for a single-stage schedule, v for a multi-stage one.
        n_microbatches: N, microbatches per step (the batch is split on dim 0).
        loss_fn: per-unit loss, see the module docstring.
        split_backward: run each backward as an input pass (I) and a weight
            pass (W) instead of one full backward (B).
        scale_grads: divide gradients by the number of units; leave False with
            a token-normalised loss.
    """

    actions_fn: ClassVar[Callable[..., ActionLists]]
    stages_per_rank: ClassVar[int] = 1
    """Model chunks per rank: 1 for a single-stage schedule; a multi-stage
    one's default v (its ``actions_fn`` takes ``stages_per_rank``, set from
    ``len(stages)`` at run time)."""
    parameter_copies: ClassVar[int] = 1
    """Copies of each model chunk across the pipeline."""
    stage_placement: ClassVar[str] = "loop"
    """Stage -> rank placement (``generate_stage_to_rank_mapping`` style)."""

    def __init__(
        self,
        stages: SequencePipelineStage | list[SequencePipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        split_backward: bool = False,
        scale_grads: bool = False,
    ) -> None:
        stages = stages if isinstance(stages, list) else [stages]
        for s in stages:
            if not isinstance(s, SequencePipelineStage):
                raise TypeError(
                    f"{type(self).__name__} needs SequencePipelineStage stages, got {type(s).__name__}"
                )
        if self.stages_per_rank == 1 and len(stages) != 1:
            raise ValueError(f"{type(self).__name__} runs one stage per rank, got {len(stages)}")
        lengths = stages[0].lengths
        if any(s.lengths != lengths for s in stages):
            raise ValueError("all stages of a sequence schedule must cut sequences alike")
        self.lengths = lengths
        self.num_subsequences = k = len(lengths)
        self.num_microbatches = n_microbatches
        super().__init__(stages, n_microbatches * k, loss_fn=loss_fn, scale_grads=scale_grads)
        self._unit_losses: dict[int, torch.Tensor] = {}
        order = self.compute_order(
            self.pp_group_size, n_microbatches, k, split_backward=split_backward, stages_per_rank=len(stages)
        )
        validate_unit_order(order, k)
        self.pipeline_order = order
        self._prepare_schedule_with_comms(order)

    @classmethod
    def compute_order(
        cls,
        num_ranks: int,
        num_microbatches: int,
        num_subsequences: int,
        *,
        split_backward: bool = False,
        stages_per_rank: int | None = None,
    ) -> ActionLists:
        """The schedule's compute-only lists, {rank: [action]}, for v = ``stages_per_rank``
        (default: the class's) model chunks per rank."""
        extra = {"stages_per_rank": stages_per_rank or cls.stages_per_rank} if cls.stages_per_rank > 1 else {}
        return cls.actions_fn(num_ranks, num_microbatches, num_subsequences, split_backward=split_backward, **extra)

    @classmethod
    def check_shape(
        cls, num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False
    ) -> None:
        """Raise ValueError, naming the setting, for a shape the schedule cannot run."""
        cls.compute_order(num_ranks, num_microbatches, num_subsequences, split_backward=split_backward)

    # torch files each loss under the position at which it was computed (a
    # list); here it is filed under its unit id, for last stages that run
    # units in any order, or only some of them.
    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        if stage.is_last and self._loss_fn is not None:
            self._unit_losses[mb_index] = self._compute_loss(output, target_mbs[mb_index], loss_kwargs)

    def _maybe_get_loss(self, stage, mb_index):
        if not (stage.is_last and self._loss_fn is not None):
            return None
        loss = self._unit_losses[mb_index]
        # Kept attached, the loss would pin the unit's graph until the step ends.
        self._unit_losses[mb_index] = loss.detach()
        return loss

    def _update_losses(self, stages, losses):
        """Per-unit losses of this rank's last stages, in unit-id order; 0 for units they do not run."""
        if losses is not None and any(s.is_last for s in self._stages):
            zero = next(iter(self._unit_losses.values())).new_zeros(())
            losses.clear()
            losses.extend(self._unit_losses.get(u, zero) for u in range(self._n_microbatches))
        self._unit_losses.clear()

    def _split_units(self, t: torch.Tensor, name: str) -> list[torch.Tensor]:
        """(batch, seq, ...) -> N k tensors (batch / N, L_j, ...), unit-id order."""
        if t.shape[0] % self.num_microbatches:
            raise ValueError(
                f"{name} has batch size {t.shape[0]}, not a multiple of the "
                f"{self.num_microbatches} microbatches"
            )
        if t.shape[1] != sum(self.lengths):
            raise ValueError(
                f"{name} has sequence length {t.shape[1]}, but the schedule cuts "
                f"{sum(self.lengths)} tokens into subsequences {self.lengths}"
            )
        return [
            unit
            for mb in t.tensor_split(self.num_microbatches, dim=0)
            for unit in mb.split(self.lengths, dim=1)
        ]

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        **kwargs: Any,
    ):
        """Run one step on a whole batch; see the module docstring.

        args: the first stage's inputs, each (batch, seq_len, ...); empty on
        other ranks. target: (batch, seq_len) on the rank of the last stage.
        Returns the last stage's output, (batch, seq_len, ...), if asked for.
        """
        if kwargs:
            raise TypeError(
                f"sequence schedules take the model inputs positionally, got {sorted(kwargs)}"
            )
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() needs gradients enabled; use eval() for inference")
        n = self._n_microbatches
        per_arg = [self._split_units(a, f"input {i}") for i, a in enumerate(args)]
        arg_units = [tuple(units[u] for units in per_arg) for u in range(n)]
        target_units = self._split_units(target, "target") if target is not None else None
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        unit_losses = [] if losses is not None else None
        try:
            self._step_microbatches(arg_units, [{}] * n, target_units, unit_losses, return_outputs)
        finally:
            for stage in self._stages:
                stage.kv_context.clear()
        k = self.num_subsequences
        if unit_losses:
            losses.clear()
            losses.extend(sum(unit_losses[m * k:(m + 1) * k]) for m in range(self.num_microbatches))
        for stage in self._stages:
            if stage.is_last and return_outputs:
                outs = stage.output_chunks
                return torch.cat(
                    [torch.cat(outs[m * k:(m + 1) * k], dim=1) for m in range(self.num_microbatches)]
                )
        return None


class ScheduleSeq1F1B(SequenceSchedule):
    """Seq1F1B: 1F1B over (microbatch, subsequence) units; see :func:`seq1f1b_actions`."""

    actions_fn = staticmethod(seq1f1b_actions)


class ScheduleTeraPipe(SequenceSchedule):
    """TeraPipe: GPipe over units; see :func:`terapipe_actions`."""

    actions_fn = staticmethod(terapipe_actions)


class ScheduleInterleavedSeq1F1B(SequenceSchedule):
    """Seq1F1B-I: interleaved 1F1B over units, v stages per rank in loop placement;
    see :func:`interleaved_seq1f1b_actions`."""

    actions_fn = staticmethod(interleaved_seq1f1b_actions)
    stages_per_rank = 2


class ScheduleBSIPipe(SequenceSchedule):
    """BSIPipe: two V-shaped pipelines in opposite directions over units; see
    :func:`bsipipe_actions` and :mod:`torchtitan_seq.bidirectional`.

    Each rank holds four stages (chunks {q, 2p-1-q} of chain A and
    {p-1-q, p+q} of chain B at position q), built with ``chain_length = 2p``.
    The two copies of each chunk are one model: a step starts from identical
    copies (the first step copies A's over B's) and ends with each chunk's
    whole gradient on its chain-A copy and none on its chain-B copy, so an
    optimizer over all parameters steps each chunk once; call
    :meth:`sync_copies` after each optimizer step. ``step()`` returns no
    outputs: each last stage sees half of the microbatches.

    Args (beyond :class:`SequenceSchedule`'s):
        placement: position -> rank, see :data:`~torchtitan_seq.bidirectional.PLACEMENTS`.
    """

    actions_fn = staticmethod(bsipipe_actions)
    stages_per_rank = 4
    parameter_copies = 2
    stage_placement = "bidirectional"

    def __init__(
        self,
        stages: list[SequencePipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        split_backward: bool = False,
        scale_grads: bool = False,
        placement: str = "paired",
    ) -> None:
        self.layout = BidirectionalLayout(stages[0].group_size, placement)
        held = sorted(s.stage_index for s in stages)
        if held != self.layout.stages_of_rank(stages[0].group_rank):
            raise ValueError(
                f"pipeline rank {stages[0].group_rank} holds stages {held}, but BSIPipe's "
                f"{placement!r} layout puts {self.layout.stages_of_rank(stages[0].group_rank)} there"
            )
        super().__init__(stages, n_microbatches, loss_fn, split_backward=split_backward, scale_grads=scale_grads)
        self.copies = MirroredCopies({s.stage_index: s.submod for s in self._stages}, self.layout, stages[0].group)
        self._copies_synced = False

    def _prepare_schedule_with_comms(self, actions, format="compute_only"):
        order = {self.layout.rank_of_position(q): acts for q, acts in actions.items()}
        self.pipeline_order = order
        self.stage_index_to_group_rank = self.layout.stage_to_rank()
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.pipeline_order_with_comms = lower_chains(
            order, self.stage_index_to_group_rank, self.layout.chain_length, self._n_microbatches // 2
        )

    @classmethod
    def check_shape(
        cls, num_ranks: int, num_microbatches: int, num_subsequences: int, *, split_backward: bool = False
    ) -> None:
        # Without building the lists: their list scheduling takes seconds at large shapes.
        _check_bsipipe_shape(num_ranks, num_microbatches, split_backward)

    def sync_copies(self) -> None:
        """Copy each chunk's chain-A values over its chain-B copy (after an optimizer step)."""
        self.copies.sync_parameters()
        self._copies_synced = True

    def step(self, *args, target=None, losses=None, return_outputs: bool = True, **kwargs) -> None:
        if not self._copies_synced:
            self.sync_copies()
        super().step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if self._has_backward:
            self.copies.combine_gradients()


# Names users select in ``[parallelism] pipeline_parallel_schedule``.
SEQUENCE_SCHEDULES: dict[str, type[SequenceSchedule]] = {
    "Seq1F1B": ScheduleSeq1F1B,
    "TeraPipe": ScheduleTeraPipe,
    "InterleavedSeq1F1B": ScheduleInterleavedSeq1F1B,
    "BSIPipe": ScheduleBSIPipe,
}
