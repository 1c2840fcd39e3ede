"""torchtitan's Llama 3 with chunk-aware attention: the model the sequence schedules run.

``SeqTransformer`` is torchtitan's ``Transformer`` with each layer's inner
attention replaced by :class:`~torchtitan_seq.attention.SequenceAttention`.
Its parameters, FQNs, initialisation, TP plan and checkpoints are Llama 3's.
A stage binds its KV context with
:func:`~torchtitan_seq.attention.bind_kv_context`.
While a pipeline stage runs a unit at offset s, the model reads RoPE at
positions [s, s+L) (torchtitan's ``positions`` argument) and each layer
attends through the stage's KV context; otherwise it is plain Llama 3.
"""

from __future__ import annotations

import torch
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.models.llama3 import llama3_args as _llama3_flavors

from ...attention import SequenceAttention
from ...kv_context import KVContext, Unit

__all__ = ["SeqTransformer", "seq_llama3_flavors", "unit_positions"]


class SeqTransformer(Transformer):
    """Llama 3 whose attention can run one (microbatch, subsequence) unit at a time."""

    def __init__(self, model_args: TransformerModelArgs):
        if model_args.attn_type != "sdpa":
            raise ValueError(
                f"model attn_type={model_args.attn_type!r}: the sequence model replaces "
                "SDPA attention; pick a flavor with attn_type 'sdpa'"
            )
        super().__init__(model_args)
        self.kv_context: KVContext | None = None
        for layer_id, layer in self.layers.items():
            layer.attention.inner_attention = SequenceAttention(int(layer_id))

    def forward(
        self,
        tokens: torch.Tensor,
        attention_masks=None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: (B, L) ids on the first stage, else (B, L, dim) activations (L / tp with SP)."""
        unit = self.kv_context.unit if self.kv_context is not None else None
        if unit is not None and positions is None:
            positions = unit_positions(unit, tokens.device)
        return super().forward(tokens, attention_masks, positions)


def unit_positions(unit: Unit, device: torch.device) -> torch.Tensor:
    """RoPE positions of ``unit``: (1, L), the range [offset, offset + L) of the whole sequence.

    Under sequence parallelism a stage's input holds only its shard of the
    unit; RoPE is applied after the gather, to the whole unit.
    """
    return torch.arange(unit.offset, unit.offset + unit.length, device=device).unsqueeze(0)


# Llama 3's flavors whose attention is SDPA, with their own names.
seq_llama3_flavors: dict[str, TransformerModelArgs] = {
    name: args for name, args in _llama3_flavors.items() if args.attn_type == "sdpa"
}
