"""The runtime every sequence schedule shares: ``SequenceSchedule``.

A schedule class names its pure action-list function (``actions_fn``) and tells the pipeline builder
and the trainer what they need through class attributes and hooks (the class's members below). The
lists are checked against :mod:`torchtitan_seq.schedules.ordering`'s rules; lowering (send/recv, FSDP
unshard/reshard, gradient reduction) and execution are torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from torchtitan_seq.runtime.documents import Documents
from torchtitan_seq.runtime.torch_internals import Action, allow_recompiles
from torchtitan_seq.schedules.ordering import validate_unit_order
from torchtitan_seq.schedules.stage import SequencePipelineStage
from torchtitan_seq.schedules.unit_losses import UnitLossRuntime

__all__ = ["ActionLists", "ScheduleShape", "SequenceSchedule", "StagePlacement"]

ActionLists = dict[int, list[Action | None]]
"""What a schedule's ``actions_fn`` returns: per rank, its compute-only actions in order."""

StagePlacement = list[list[tuple[int, int]]]
"""Per pipeline rank, the (stage index, model chunk index) pairs it holds."""


@dataclass(frozen=True)
class ScheduleShape:
    """What a schedule's lists are built for: p ranks (``num_ranks``), N microbatches per step
    (``num_microbatches``) of k subsequences each (``num_subsequences``, units ``m * k + j``),
    backward as one pass or as input- and weight-gradient passes (``split_backward``), and v model
    chunks per rank (``stages_per_rank``; None: the schedule's own, which :meth:`SequenceSchedule.compute_order`
    fills in before the schedule's ``actions_fn`` sees it)."""

    num_ranks: int
    num_microbatches: int
    num_subsequences: int
    split_backward: bool = False
    stages_per_rank: int | None = None


class SequenceSchedule(UnitLossRuntime):
    """Base of the sequence schedules: runs N microbatches as N k units.

    Args:
        stages: this rank's :class:`SequencePipelineStage`, or a list of them (v for a multi-stage schedule).
        n_microbatches: N, microbatches per step (the batch is split on dim 0).
        loss_fn: per-unit loss, see the package docstring.
        split_backward: run each backward as an input pass (I) and a weight pass (W), not one full backward (B).
        scale_grads: divide gradients by the number of units; leave False with a token-normalised loss.
    """

    actions_fn: ClassVar[Callable[[ScheduleShape], ActionLists]]
    """The schedule's lists for a shape whose ``stages_per_rank`` is set (see :meth:`compute_order`)."""
    stages_per_rank: ClassVar[int] = 1
    """Model chunks per rank; over 1, the default v of a multi-stage schedule."""
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
        if wrong := [type(s).__name__ for s in stages if not isinstance(s, SequencePipelineStage)]:
            raise TypeError(f"{type(self).__name__} needs SequencePipelineStage stages, got {wrong[0]}")
        if self.stages_per_rank == 1 and len(stages) != 1:
            raise ValueError(f"{type(self).__name__} runs one stage per rank, got {len(stages)}")
        self.lengths = lengths = stages[0].lengths
        if any(s.lengths != lengths for s in stages):
            raise ValueError("all stages of a sequence schedule must cut sequences alike")
        # torch.compile: at most a graph per distinct unit length (and the shape inference's)
        allow_recompiles(len(set(lengths)) + 1)
        self.num_subsequences = k = len(lengths)
        self.num_microbatches = n_microbatches
        super().__init__(stages, n_microbatches * k, loss_fn=loss_fn, scale_grads=scale_grads)
        order = self.compute_order(ScheduleShape(self.pp_group_size, n_microbatches, k, split_backward, len(stages)))
        validate_unit_order(order, k)
        self.pipeline_order = order
        for stage in stages:
            stage.expect(order[self.rank])
        self.lower(order)

    @classmethod
    def compute_order(cls, shape: ScheduleShape) -> ActionLists:
        """The schedule's compute-only lists for ``shape``, {rank: [action]}; v: the class's unless the shape says."""
        return cls.actions_fn(replace(shape, stages_per_rank=shape.stages_per_rank or cls.stages_per_rank))

    @classmethod
    def check_shape(cls, shape: ScheduleShape, **options: Any) -> None:
        """Raise ValueError, naming the setting, for a shape the schedule cannot run (``options``: the
        schedule's own, as :meth:`options_from_config` reads them)."""
        cls.compute_order(shape)

    @classmethod
    def check_torch(cls) -> None:
        """Raise ValueError where the installed torch cannot run the schedule (every torch the
        package supports can, unless a schedule says otherwise)."""

    @classmethod
    def options_from_config(cls, config: Any) -> dict[str, Any]:
        """Keywords for the constructor, :meth:`place_stages` and :meth:`check_shape` from ``[sequence_pipeline]``."""
        return {}

    @classmethod
    def place_stages(cls, num_ranks: int, num_chunks: int, **options: Any) -> StagePlacement:
        """Which stages each rank holds and which model chunk each runs (``parameter_copies``
        chains of ``num_chunks`` stages). Loop placement: rank r holds stages r, r + p, ...,
        and stage s runs chunk s."""
        return [[(s, s) for s in range(r, num_chunks, num_ranks)] for r in range(num_ranks)]

    def describe(self) -> str | None:
        """What to log about this schedule's layout at start-up, if anything."""
        return None

    def after_optimizer_step(self) -> None:
        """Work after each optimizer step (the trainer calls it from an optimizer hook)."""

    def _split_units(self, t: torch.Tensor, name: str) -> list[torch.Tensor]:
        """(batch, seq, ...) -> N k tensors (batch / N, L_j, ...), unit-id order; under context
        parallelism this rank's share of each unit, (batch / N, L_j / c, ...)."""
        if t.shape[0] % self.num_microbatches:
            raise ValueError(
                f"{name} has batch size {t.shape[0]}, not a multiple of the {self.num_microbatches} microbatches"
            )
        if t.shape[1] != sum(self.lengths):
            raise ValueError(
                f"{name} has sequence length {t.shape[1]}, but the schedule cuts "
                f"{sum(self.lengths)} tokens into subsequences {self.lengths}"
            )
        shard = self.stages[0].kv_context.shard  # a CP rank's share of each unit
        return [shard.shard(unit) for mb in t.tensor_split(self.num_microbatches) for unit in mb.split(self.lengths, 1)]

    def _whole(self, mbs: list | None, name: str) -> Any:
        """Pre-split microbatches (one entry per microbatch) -> the whole batch they split."""
        if mbs is None:
            return None
        if not isinstance(mbs, list) or len(mbs) != self.num_microbatches:
            raise ValueError(f"{name} needs a list of one entry per microbatch ({self.num_microbatches})")
        if isinstance(mbs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*mbs))
        return torch.cat(mbs)

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        attention_masks: torch.Tensor | None = None,
        arg_mbs: list[tuple] | None = None,
        kwarg_mbs: list[dict] | None = None,
        target_mbs: list | None = None,
        finalize_gradients: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor | None:
        """Run one step on a whole batch, or on its microbatches split as torch 2.14's ``step`` takes
        them; see the package docstring. Pass either the whole batch (``args``, ``target``,
        ``attention_masks``) or its microbatches (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``). Under
        context parallelism every CP rank passes the whole batch and takes its share of each unit itself.

        Args:
            *args: the first stage's inputs, each (batch, seq_len, ...); none on other ranks.
            target: the labels, (batch, seq_len), on the rank of the last stage.
            losses: a list that receives one loss per microbatch on the last stage's rank, as with
                torch's schedules; None: not collected.
            return_outputs: whether to return the last stage's output.
            loss_kwargs: keyword arguments for the loss function.
            attention_masks: packed documents, (batch, seq_len) document ids
                (:func:`~torchtitan_seq.runtime.documents.document_ids`) on every rank, as torchtitan
                passes its block-causal flavors' masks; None: causal attention.
            arg_mbs: one tuple of inputs per microbatch, each (batch / N, seq_len, ...).
            kwarg_mbs: one dict per microbatch, holding at most ``attention_masks`` (batch / N, seq_len).
            target_mbs: one (batch / N, seq_len) tensor of labels per microbatch.
            finalize_gradients: False leaves FSDP's gradients unreduced for a later step (torch 2.15).
            **kwargs: refused: sequence schedules take the model inputs positionally.

        Returns:
            The last stage's output, (batch, seq_len, ...), on its rank where ``return_outputs`` (under
            CP this rank's shares, (batch, seq_len / c, ...)); else None.
        """
        if kwargs:
            raise TypeError(f"sequence schedules take the model inputs positionally, got {sorted(kwargs)}")
        if self.runs_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() needs gradients enabled; use eval() for inference")
        if arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None:
            if args or target is not None or attention_masks is not None:
                raise ValueError("pass either the whole batch or its microbatches (arg_mbs, ...), not both")
            masks = [mb.get("attention_masks") for mb in kwarg_mbs or [{}] * self.num_microbatches]
            if extra := {key for mb in kwarg_mbs or [] for key in mb} - {"attention_masks"}:
                raise TypeError(f"sequence schedules take the model inputs positionally, got {sorted(extra)}")
            args = self._whole(arg_mbs, "arg_mbs") or ()
            target = self._whole(target_mbs, "target_mbs")
            attention_masks = None if masks[0] is None else self._whole(masks, "kwarg_mbs' attention_masks")
        n, k, mbs = self.num_units, self.num_subsequences, self.num_microbatches
        per_arg = [self._split_units(a, f"input {i}") for i, a in enumerate(args)]
        arg_units = [tuple(units[u] for units in per_arg) for u in range(n)]
        target_units = self._split_units(target, "target") if target is not None else None
        documents = None
        if attention_masks is not None:
            self._split_units(attention_masks, "attention_masks")  # checks its shape
            documents = Documents.from_ids(attention_masks).split(mbs)  # one host read per step
        for stage in self.stages:
            stage.has_backward = stage.kv_context.trains = self.runs_backward
            stage.clear_runtime_states()
            stage.kv_context.documents = documents
            stage.keep_outputs = return_outputs
        unit_losses = [] if losses is not None else None
        try:
            self.run_units(arg_units, [{}] * n, target_units, unit_losses, loss_kwargs, finalize_gradients)
        finally:
            for stage in self.stages:
                stage.kv_context.clear()
        if unit_losses:
            # two ops a microbatch, not an add per unit (a launch each on a GPU)
            losses[:] = [torch.stack(unit_losses[m * k : (m + 1) * k]).sum() for m in range(mbs)]
        outs = next((stage.unit_outputs for stage in self.stages if stage.is_last), None)
        if return_outputs and outs:
            ran = sorted({u // k for u in outs})
            return torch.cat([torch.cat([outs[m * k + j] for j in range(k)], dim=1) for m in ran])
        return None
