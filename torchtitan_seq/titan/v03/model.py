"""torchtitan 0.3's Llama 3 with chunk-aware attention: the model the sequence schedules run there.

0.3 builds a model from configs, and its attention takes the inner attention as a config of its own
(``GQAttention.Config.inner_attention``): :class:`SeqInnerAttention` is that plug, a
:class:`~torchtitan_seq.attention.SequenceAttention` in 0.3's (B, L, heads, head_dim) layout.
:func:`seq_llama3` swaps it into every layer of a flavor of 0.3's ``model_registry``, so parameters,
FQNs, initialisation, TP plan and checkpoints stay Llama 3's. While a pipeline stage runs a unit at
offset s, :class:`SeqLlama3Model` reads RoPE at positions [s, s+L) (a CP rank at its share's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.models.llama3 import Llama3Model, model_registry
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.runtime.kv_context import KVContext
from torchtitan_seq.runtime.rope import UnitPositions

__all__ = ["SeqInnerAttention", "SeqLlama3Model", "seq_llama3"]


class SeqInnerAttention(Module, SequenceAttention):
    """0.3's inner attention (q, k, v as (B, L, heads, head_dim), out the same) that runs
    :class:`~torchtitan_seq.attention.SequenceAttention`: causal, or block-causal given a packed
    batch's (B, L) document ids as ``attention_masks``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        layer_id: int
        """The layer's index: names its slab in a stage's KV context."""

    def __init__(self, config: Config) -> None:
        """The inner attention of layer ``config.layer_id``.

        Args:
            config: its config.
        """
        SequenceAttention.__init__(self, config.layer_id)

    # 0.3's argument names: its sharding config (local_map under TP) maps them to placements.
    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        """Attention over the unit the stage's KV context runs, or over the whole sequence outside a unit.

        Args:
            q_BLNH: (B, L, Hq, D) queries, post-RoPE.
            k_BLNH: (B, L, Hkv, D) keys, post-RoPE, before GQA expansion.
            v_BLNH: (B, L, Hkv, D) values, before GQA expansion.
            attention_masks: None (causal) or (B, L) document ids (block-causal).
            scale: the softmax scale; None: D ** -0.5.
            enable_gqa: SDPA's, on the unbound causal path; units take grouped K/V heads as they are.
            is_causal: must be True for a unit and for packed documents.

        Returns:
            (B, L, Hq, D) attention output.
        """
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # to SequenceAttention's B, N, L, H
        out = SequenceAttention.forward(
            self, q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal, documents=attention_masks
        )
        return out.transpose(1, 2)


class SeqLlama3Model(Llama3Model):
    """0.3's Llama 3 whose attention can run one (microbatch, subsequence) unit at a time."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        block_causal: bool = False
        """Packed documents: attention stops at each EOS (the trainer passes document ids)."""

    def __init__(self, config: Config) -> None:
        """0.3's Llama 3 model, with no unit running.

        Args:
            config: its config, the flavor's with ``block_causal``.
        """
        super().__init__(config)
        self.kv_context: KVContext | None = None
        self._positions = UnitPositions()

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """0.3's forward, with RoPE at the unit's positions while a pipeline stage runs a unit.

        Args:
            tokens: (B, L) ids on the first stage, else (B, L, dim) activations.
            positions: RoPE positions; None: the running unit's (:class:`UnitPositions`), or the model's
                own outside a unit.
            attention_masks: None (causal) or (B, L) document ids (block-causal).

        Returns:
            (B, L, vocab) logits on the last stage, else (B, L, dim) activations; contiguous.
        """
        if positions is None:
            positions = self._positions.of(self.kv_context, tokens.device)
        # Under 0.3's sequence parallelism (TP) a stage's output, (B, L, dim) sharded on L, is a view that is
        # not contiguous once a microbatch holds more than one row; torch's stage sends it as it is, and gloo
        # refuses ("input tensor has to be contiguous"). A no-op on a contiguous output.
        return super().forward(tokens, positions, attention_masks).contiguous()


FLAVORS: dict[str, tuple[str, bool]] = {
    "debugmodel": ("debugmodel", False),
    "debugmodel_flex_attn": ("debugmodel", True),
    "8B": ("8B", False),
    "8B_flex": ("8B", True),
    "debugmodel_varlen_attn": ("debugmodel", True),
    "8B_varlen": ("8B", True),
    "70B": ("70B", False),
    "405B": ("405B", False),
}
"""Per flavor name (0.2.2's, as the shipped configs, the planner and :mod:`torchtitan_seq.titan.flavors`
name them): 0.3's Llama 3 flavor and whether attention is block-causal (where 0.2.2's flex and varlen
flavors are)."""


def seq_llama3(flavor: str, pipelining_fn: Callable[..., Any]) -> ModelSpec:
    """0.3's Llama 3 model spec of a flavor, with chunk-aware attention, under the name ``llama3_seq``.

    Args:
        flavor: a key of :data:`FLAVORS` (0.2.2's flavor names).
        pipelining_fn: the spec's pipelining function, e.g.
            :func:`~torchtitan_seq.titan.v03.pipeline.pipeline_sequence_llm`.

    Returns:
        0.3's spec of the flavor's Llama 3 with :class:`SeqInnerAttention` in every layer, built as
        :class:`SeqLlama3Model` (block-causal where :data:`FLAVORS` says), pipelined by ``pipelining_fn``.
    """
    base_flavor, block_causal = FLAVORS[flavor]
    spec = model_registry(base_flavor)  # its inner attention (flex) is replaced below
    base = spec.model
    for layer_id, layer in enumerate(base.layers):
        layer.attention.inner_attention = SeqInnerAttention.Config(layer_id=layer_id)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    model = SeqLlama3Model.Config(**fields, block_causal=block_causal)
    return dataclasses.replace(spec, name="llama3_seq", flavor=flavor, model=model, pipelining_fn=pipelining_fn)
