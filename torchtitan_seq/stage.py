"""The pipeline stage of a sequence schedule: torch's ``PipelineStage`` for a model chunk that runs
(microbatch, subsequence) units, which torch numbers as microbatches (``unit id = m * k + j``). Each
unit runs announced to the stage's :class:`~torchtitan_seq.kv_context.KVContext`, with receive
buffers of its own length, and timed for :data:`torchtitan_seq.timeline.RECORDER`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils._pytree import tree_map_only

from .attention import AttentionKernel, bind_kv_context, select_kernel
from .kv_context import KVContext, Unit
from .ordering import B, F, I, W
from .timeline import RECORDER

__all__ = ["SequencePipelineStage"]


class SequencePipelineStage(PipelineStage):
    """A pipeline stage whose microbatches are cut into subsequences (sequence dimension 1).

    ``submodule`` is the model chunk, with :class:`~torchtitan_seq.attention.SequenceAttention`
    layers; ``lengths`` are the subsequence lengths [L_0, ..., L_{k-1}] of every microbatch;
    ``kernel`` is the block attention kernel, chosen for ``device`` when omitted. Where the
    stages form several chains (BSIPipe's and Chimera's two), stage s is first of its chain when
    s % ``chain_length`` == 0 (one chain by default). The other arguments are ``PipelineStage``'s.
    """

    def __init__(
        self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device, *, lengths: list[int],
        kernel: AttentionKernel | None = None, chain_length: int | None = None, **kwargs: Any,
    ) -> None:
        self.chain_length = chain_length or num_stages
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"subsequence lengths must be positive, got {lengths}")
        self.lengths = list(lengths)
        self.kv_context = KVContext(self.lengths)
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

    def unit(self, unit_id: int) -> Unit:
        """The (microbatch, subsequence) unit behind torch's microbatch index."""
        m, j = divmod(unit_id, len(self.lengths))
        return Unit(m, j, sum(self.lengths[:j]), self.lengths[j], len(self.lengths))

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        with RECORDER.action(self.stage_index, F, fwd_chunk_id), self.kv_context.running(self.unit(fwd_chunk_id)):
            output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.is_last and save_forward_output:
            # The outputs kept for the step's return value must not pin the unit's graph. torch detaches
            # them in backward, but not views (the local logits under TP are), and a split backward's
            # input pass retains the graph: what the weight pass does not free would outlive the step.
            self.output_chunks[-1] = tree_map_only(torch.Tensor, torch.Tensor.detach, self.output_chunks[-1])
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss: torch.Tensor | None = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        timed = RECORDER.action(self.stage_index, B if full_backward else I, bwd_chunk_id)
        with timed, self.kv_context.backward(self.unit(bwd_chunk_id), last_pass=full_backward):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        with RECORDER.action(self.stage_index, W, bwd_chunk_id), self.kv_context.backward(self.unit(bwd_chunk_id)):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self.kv_context.clear()
        RECORDER.start_step()  # torch's schedules clear the stages as a step begins

    def _size_recv_buffers(self, infos_by_unit: dict) -> None:
        """Resize torch's receive metadata and buffers, made for unit 0, to each unit's length; shapes
        scale, so a tensor whose sequence is sharded (TP's sequence parallel) keeps its fraction."""
        for unit_id, infos in infos_by_unit.items():
            length = self.lengths[unit_id % len(self.lengths)]
            for info in infos:
                if info.is_root_arg or info.tensor_meta is None:
                    continue
                changes = {}
                for prefix in ("", "global_"):
                    if shape := list(getattr(info.tensor_meta, f"{prefix}shape", None) or ()):
                        shape[1] = shape[1] * length // self.lengths[0]
                        changes[f"{prefix}shape"] = torch.Size(shape)
                        changes[f"{prefix}stride"] = torch.empty(shape, device="meta").stride()
                info.tensor_meta = meta = dataclasses.replace(info.tensor_meta, **changes)
                grad = info.buffer.requires_grad
                info.buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device, requires_grad=grad)

    def _prepare_forward_infra(self, num_microbatches, args, kwargs=None, has_backward=False):
        # Metadata inference runs the chunk on unit 0 outside any unit: plain causal attention, nothing cached.
        out = super()._prepare_forward_infra(num_microbatches, args, kwargs, has_backward)
        self._size_recv_buffers(self.args_recv_info)
        return out

    def _prepare_backward_infra(self, num_microbatches, *args, **kwargs):
        out = super()._prepare_backward_infra(num_microbatches, *args, **kwargs)
        self._size_recv_buffers(self.grad_recv_info)
        return out
