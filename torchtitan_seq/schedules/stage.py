"""The pipeline stage of a sequence schedule: torch's ``PipelineStage`` for a model chunk that runs
(microbatch, subsequence) units, which torch numbers as microbatches (``unit id = m * k + j``). Each
unit runs announced to the stage's :class:`~torchtitan_seq.runtime.kv_context.KVContext`, with receive
buffers of its own length, and timed for :data:`torchtitan_seq.instrumentation.timeline.RECORDER`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan_seq.attention import bind_kv_context
from torchtitan_seq.attention.kernels import AttentionKernel, select_kernel
from torchtitan_seq.instrumentation.timeline import RECORDER
from torchtitan_seq.runtime.context_parallel import ContextShard
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.kv_offload import KVOffload
from torchtitan_seq.runtime.reach import KVContextMode
from torchtitan_seq.runtime.torch_internals import UnitStageBase, detach_tensors, keep_async_collective_input_grads
from torchtitan_seq.schedules.ordering import B, F, I, W, stage_passes
from torchtitan_seq.schedules.receives import scale_receives

__all__ = ["SequencePipelineStage"]


class SequencePipelineStage(UnitStageBase):
    """A pipeline stage whose microbatches are cut into subsequences (sequence dimension 1).

    Args:
        submodule: the model chunk, with :class:`~torchtitan_seq.attention.SequenceAttention` layers.
        stage_index: the stage's index, as ``PipelineStage`` takes it.
        num_stages: the pipeline's stages, as ``PipelineStage`` takes it.
        device: the device the chunk runs on.
        lengths: the subsequence lengths [L_0, ..., L_{k-1}] of every microbatch.
        kernel: the block attention kernel; None: :func:`~torchtitan_seq.attention.kernels.select_kernel`'s
            for ``device``.
        chain_length: stages per chain, where the stages form several chains (BSIPipe's and Chimera's
            two): stage s is first of its chain when s % ``chain_length`` == 0. None: one chain.
        context_shard: this rank's share of every unit under context parallelism
            (:mod:`torchtitan_seq.runtime.context_parallel`); None: the whole unit.
        kv_context: what the K/V context keeps of earlier units (:data:`~torchtitan_seq.runtime.reach.KVContextMode`).
        kv_offload: whether the K/V context takes arenas no pass reads for a while to host memory
            (:mod:`~torchtitan_seq.runtime.kv_offload`).
        **kwargs: the other arguments of ``PipelineStage`` (``group``, ``dw_builder``, ...).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        *,
        lengths: list[int],
        kernel: AttentionKernel | None = None,
        chain_length: int | None = None,
        context_shard: ContextShard | None = None,
        kv_context: KVContextMode = "reach",
        kv_offload: bool = False,
        **kwargs: Any,
    ) -> None:
        self.chain_length = chain_length or num_stages
        keep_async_collective_input_grads()  # compiled blocks under TP get their first input's gradient
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"subsequence lengths must be positive, got {lengths}")
        self.lengths = list(lengths)
        self.kv_context = KVContext(self.lengths, context_shard, kv_context)
        if kv_offload:
            self.kv_context.offload = KVOffload(self.kv_context.arenas)
        self.keep_outputs = False
        """Whether a last stage keeps each unit's output for the step's return value (the schedule sets it)."""
        self.unit_outputs: dict[int, Any] = {}
        """unit id -> its output, detached, while :attr:`keep_outputs`."""
        bind_kv_context(submodule, self.kv_context, kernel or select_kernel(torch.device(device)))

    @property
    def is_first(self) -> bool:
        return self.stage_index % self.chain_length == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index % self.chain_length == self.chain_length - 1

    # torch's runtime hands a stage's output straight to stage index + 1 (and an input gradient to
    # index - 1) when that stage is on the same rank (its V-schedule special case). Across the end of
    # a chain nothing flows: with Chimera's two straight chains, chain A's last stage and chain B's
    # first share a rank and adjacent indices.
    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        if not self.is_first:
            super().set_local_fwd_input(prev_stage_outputs, mb_index)

    def get_local_bwd_output(self, mb_index: int) -> tuple:
        return () if self.is_first else super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
        if not self.is_last:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def expect(self, actions: list) -> None:
        """Tell the KV context the order of this stage's passes among its rank's compute ``actions``."""
        self.kv_context.expect(stage_passes(actions, self.stage_index, len(self.lengths))[1])
        if self.kv_context.offload is not None:
            self.kv_context.offload.expect(stage_passes(actions, self.stage_index, len(self.lengths), (F, I, B, W))[1])

    def unit_length(self, unit_id: int) -> int:
        return self.lengths[unit_id % len(self.lengths)]

    def resize_receives(self, receives_by_unit: dict) -> None:
        scale_receives(receives_by_unit, self.unit_length, self.device)

    def unit(self, unit_id: int) -> Unit:
        """The (microbatch, subsequence) unit behind torch's microbatch index."""
        m, j = divmod(unit_id, len(self.lengths))
        offset, length, shard = sum(self.lengths[:j]), self.lengths[j], self.kv_context.shard
        queries = shard.segments(offset, length) if shard.size > 1 else None
        return Unit(m, j, offset, length, len(self.lengths), queries)

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        with RECORDER.action(self.stage_index, F, fwd_chunk_id), self.kv_context.running(self.unit(fwd_chunk_id)):
            output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.is_last and self.keep_outputs:
            # Kept detached: an output kept for the step's return value must not pin the unit's graph (a
            # split backward's input pass retains it, and what the weight pass does not free would
            # outlive the step).
            self.unit_outputs[fwd_chunk_id] = detach_tensors(output)
        return output

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        timed = RECORDER.action(self.stage_index, B if full_backward else I, bwd_chunk_id)
        with timed, self.kv_context.backward(self.unit(bwd_chunk_id), last_pass=full_backward):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        with RECORDER.action(self.stage_index, W, bwd_chunk_id), self.kv_context.backward(self.unit(bwd_chunk_id)):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self.unit_outputs.clear()
        self.kv_context.clear()
        RECORDER.start_step()  # torch's schedules clear the stages as a step begins
