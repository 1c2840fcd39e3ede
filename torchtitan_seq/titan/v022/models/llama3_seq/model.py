"""torchtitan's Llama 3 with chunk-aware attention: the model the sequence schedules run.

Its parameters, FQNs, initialisation, TP plan and checkpoints are Llama 3's, and every Llama 3
flavor is offered under its torchtitan name; the block-causal ones (``debugmodel_flex_attn``,
``8B_varlen``, ...) get the batch's document ids (:mod:`torchtitan_seq.runtime.documents`) as their
``attention_masks``, whatever kernel runs. While a pipeline stage runs a unit at offset s, the model
reads RoPE at positions [s, s+L) (a CP rank at its share's) and each layer attends through the stage's KV context
(:func:`~torchtitan_seq.attention.bind_kv_context`); otherwise it is plain Llama 3.
"""

from __future__ import annotations

import dataclasses

import torch
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.models.llama3 import llama3_args as _llama3_flavors
from torchtitan.models.llama3.model.model import Attention, apply_rotary_emb

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.runtime.documents import document_ids
from torchtitan_seq.runtime.kv_context import KVContext
from torchtitan_seq.runtime.rope import UnitPositions

__all__ = ["SeqAttention", "SeqTransformer", "seq_llama3_flavors"]

seq_llama3_flavors: dict[str, TransformerModelArgs] = dict(_llama3_flavors)
"""Llama 3's flavors under their own names: SDPA ones causal, flex and varlen ones block-causal."""


class SeqAttention(Attention):
    """torchtitan's Llama 3 attention (same parameters) whose inner attention is a
    :class:`SequenceAttention` and also takes a packed batch's document ids."""

    def __init__(self, model_args: TransformerModelArgs, layer_id: int):
        """Llama 3's attention layer.

        Args:
            model_args: the flavor's model args.
            layer_id: the layer's index, which names its slab in a stage's KV context.
        """
        super().__init__(model_args)
        self.inner_attention = SequenceAttention(layer_id)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        attention_masks: torch.Tensor | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over the unit the stage's KV context runs, or over the whole sequence outside a unit.

        Args:
            x: (B, L, dim) hidden states.
            freqs_cis: the RoPE table.
            attention_masks: None (causal) or (B, L) document ids (block-causal).
            positions: (1, L) RoPE positions of the tokens, or None: 0..L-1.

        Returns:
            (B, L, dim) attention output, after the output projection.
        """
        bs, seqlen, _ = x.shape
        # -1: the local heads, which TP may have sharded
        xq, xk, xv = [w(x).view(bs, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv)]
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis, positions=positions)
        out = self.inner_attention(
            xq.transpose(1, 2),
            xk.transpose(1, 2),
            xv.transpose(1, 2),
            enable_gqa=self.enable_gqa,
            documents=attention_masks,
        )  # (B, H, L, D)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class SeqTransformer(Transformer):
    """Llama 3 whose attention can run one (microbatch, subsequence) unit at a time."""

    def __init__(self, model_args: TransformerModelArgs):
        """Llama 3 with a :class:`SeqAttention` in every layer.

        Args:
            model_args: a flavor of torchtitan's Llama 3 (SDPA, flex or varlen attention).

        Raises:
            ValueError: any other attention type.
        """
        if model_args.attn_type not in ("sdpa", "flex", "varlen"):
            raise ValueError(f"model attn_type={model_args.attn_type!r}: use a flavor of torchtitan's Llama 3")
        # torchtitan builds SDPA layers, which SeqAttention replaces; the flavor's own
        # attention type tells torchtitan's trainer to ask for attention masks.
        super().__init__(dataclasses.replace(model_args, attn_type="sdpa", attn_mask_type="causal"))
        self.model_args = model_args
        self.kv_context: KVContext | None = None
        self._positions = UnitPositions()
        sdpa_args = dataclasses.replace(model_args, attn_type="sdpa")
        for layer_id, layer in self.layers.items():
            layer.attention = SeqAttention(sdpa_args, int(layer_id))

    def get_attention_masks(
        self, input_batch: torch.Tensor, tokenizer: BaseTokenizer, extra_inputs: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """A packed batch's document ids, which block-causal flavors attend by in place of a mask.

        Every stage and every sequence schedule splits and reads the ids.

        Args:
            input_batch: (B, S) token ids.
            tokenizer: the job's tokenizer, whose EOS token ends each document.
            extra_inputs: torchtitan's other inputs, not read.

        Returns:
            (B, S) document ids (:func:`~torchtitan_seq.runtime.documents.document_ids`).

        Raises:
            TypeError: for a causal flavor, as torchtitan's models raise it.
            ValueError: a tokenizer without an EOS token.
        """
        if (mask_type := self.model_args.attn_mask_type) != "block_causal":
            # TypeError, as torchtitan's models raise it: its validator takes it for "no masks" (causal)
            raise TypeError(f"attention masks asked of a flavor with attn_mask_type={mask_type!r}")
        if tokenizer.eos_id is None:
            raise ValueError("block-causal attention needs a tokenizer with an EOS token")
        return document_ids(input_batch, tokenizer.eos_id)

    def forward(
        self, tokens: torch.Tensor, attention_masks: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Llama 3's forward, with RoPE at the unit's positions while a pipeline stage runs a unit.

        Args:
            tokens: (B, L) ids on the first stage, else (B, L, dim) activations (L / tp with SP).
            attention_masks: None (causal) or (B, L) document ids (block-causal).
            positions: RoPE positions; None: the running unit's (:class:`UnitPositions`), or 0..L-1
                outside a unit.

        Returns:
            (B, L, vocab) logits on the last stage, else (B, L, dim) activations.
        """
        if positions is None:
            positions = self._positions.of(self.kv_context, tokens.device)
        return super().forward(tokens, attention_masks, positions)
