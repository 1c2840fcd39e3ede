"""A torchtitan 0.2.2 decoder LLM with chunk-aware attention: the one seam every model family goes through.

torchtitan's LLM families (Llama 3, Qwen3, DeepSeek-V3, Llama 4, gpt-oss) share a layout: ``layers`` of
blocks, each with an ``attention`` module that projects the queries, keys and values (QK-norm, MLA, RoPE
and the family's own head dims included) and hands them, (B, heads, L, head_dim), to its
``inner_attention`` module. :func:`sequence_model_class` keeps all of that, the parameters, FQNs,
initialisation, TP plans and checkpoints the family's own, and changes these things:

- every layer's inner attention is a :class:`DocumentAttention` (a
  :class:`~torchtitan_seq.attention.SequenceAttention`) within the layer's reach (a sliding window,
  attention chunks: :func:`~torchtitan_seq.titan.v022.models.family_adapters.layer_reach`), and the
  layer takes the SDPA path whatever attention type its flavor names; a block-causal flavor's (B, S)
  document ids reach it through the layer's call (the layer hands them over on each call, so a
  recomputation under activation checkpointing reads the ids it was called with);
- while a pipeline stage runs a unit at offset s, the model reads RoPE at positions [s, s+L) (a CP
  rank at its share's, :class:`~torchtitan_seq.runtime.rope.UnitPositions`);
- an MLA layer's inner attention reads its latent and up-projection (``kv_context = "latent"``:
  :func:`~torchtitan_seq.titan.mla_latent.mla_latent`);
- a family whose blocks pick their attention's mask from a dict and whose attention merges learned
  sinks (gpt-oss) gets the call as a :class:`~torchtitan_seq.titan.v022.models.family_adapters.LayerCall`
  and merges its sinks once, inside the inner attention;
- a router's gate bias (gpt-oss's) starts at zero, as torchtitan 0.3 initialises it: 0.2.2's router
  initialises its gate's weight only, leaving the bias whatever memory it was given (NaN at times).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import TokenChoiceTopKRouter
from torchtitan.tools.utils import has_cuda_capability

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.runtime.documents import document_ids
from torchtitan_seq.runtime.kv_context import KVContext
from torchtitan_seq.runtime.reach import FULL, Reach
from torchtitan_seq.runtime.rope import UnitPositions
from torchtitan_seq.titan.mla_latent import mla_latent
from torchtitan_seq.titan.v022.models.family_adapters import (
    LayerCall,
    layer_reach,
    positions_like,
    sink_attention_class,
    stage_forward,
)

__all__ = ["DocumentAttention", "sequence_model_class", "sequence_attention_class"]


class DocumentAttention(SequenceAttention):
    """A :class:`~torchtitan_seq.attention.SequenceAttention` called as torchtitan 0.2.2's families call
    their inner attention (q, k, v, ``scale``, ``enable_gqa``; gpt-oss's ``block_mask`` and ``return_lse``),
    which attends by the document ids its layer handed it for the call (:attr:`documents`, or gpt-oss's
    :class:`~torchtitan_seq.titan.v022.models.family_adapters.LayerCall`) and merges the call's sinks."""

    def __init__(self, layer_id: int, reach: Reach = FULL) -> None:
        """The inner attention of layer ``layer_id``.

        Args:
            layer_id: the layer's index, which names its slab in a stage's KV context.
            reach: how far back the layer's queries read.
        """
        super().__init__(layer_id, reach)
        self.documents: Tensor | None = None
        """(B, L) document ids of the layer's current call; None: causal."""

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        block_mask: LayerCall | None = None,
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """:meth:`SequenceAttention.forward <torchtitan_seq.attention.SequenceAttention.forward>` with
        the layer's document ids and sinks.

        Args:
            q: (B, Hq, L, Dqk) queries, post-RoPE.
            k: (B, Hkv, L, Dqk) keys, post-RoPE.
            v: (B, Hkv, L, Dv) values (Dv: MLA's, narrower than Dqk).
            scale: the softmax scale; None: Dqk ** -0.5.
            enable_gqa: SDPA's, on the unbound causal path.
            block_mask: gpt-oss's call (documents and sinks); None: :attr:`documents`, no sinks.
            return_lse: gpt-oss's: also return a log-sum-exp it scales the output by.

        Returns:
            (B, Hq, L, Dv); with ``return_lse`` also (B, Hq, L) float32 +inf: gpt-oss scales the output
            by sigmoid(lse - sinks) to merge its sinks, which are merged already, and at +inf that factor
            is exactly 1 and its gradient exactly 0.
        """
        documents, sinks = (self.documents, None) if block_mask is None else (block_mask.documents, block_mask.sinks)
        if isinstance(sinks, DTensor) and not isinstance(q, DTensor):
            sinks = sinks.to_local()  # a TP plan that hands the inner attention its local heads (gpt-oss's)
        out = super().forward(q, k, v, scale=scale, enable_gqa=enable_gqa, documents=documents, sinks=sinks)
        if not return_lse:
            return out
        return out, torch.full(out.shape[:-1], math.inf, device=out.device)


class _DocumentsToInnerAttention(nn.Module):
    """Mixed before a family's attention class: hands the layer's document ids to its inner attention
    for the call, and takes the family's SDPA path."""

    inner_attention: DocumentAttention

    def forward(
        self, x: Tensor, rope: Tensor, attention_masks: Tensor | None, positions: Tensor | None = None
    ) -> Tensor:
        self.inner_attention.documents = attention_masks
        if positions is not None:
            positions = positions_like(rope, positions)
        return super().forward(x, rope, None, positions)


@functools.cache
def sequence_attention_class(attention_cls: type[nn.Module]) -> type[nn.Module]:
    """The family's attention class whose calls hand their document ids to a :class:`DocumentAttention`.

    Args:
        attention_cls: a torchtitan 0.2.2 attention class, called as
            ``(x, rope, attention_masks, positions)``.

    Returns:
        Its subclass (one per class), with the same parameters and state.
    """
    return type(attention_cls.__name__, (_DocumentsToInnerAttention, attention_cls), {})


class _SequenceModel(nn.Module):
    """Mixed before a family's model class; see :func:`sequence_model_class`."""

    layers: nn.ModuleDict

    def __init__(self, model_args: Any) -> None:
        moe = getattr(model_args, "moe_args", None)
        if moe is not None and moe.use_grouped_mm and not has_cuda_capability(9, 0):
            # Grouped GEMMs need sm90: experts run in a loop elsewhere, as torchtitan's Llama 4,
            # DeepSeek-V3 and gpt-oss fall back (its Qwen3 does not, and fails off sm90).
            model_args = _changed(model_args, moe_args=dataclasses.replace(moe, use_grouped_mm=False))
        # The family builds SDPA layers, whose inner attention is replaced below; the flavor's own
        # attention type tells torchtitan's trainer whether to ask for attention masks.
        super().__init__(_changed(model_args, attn_type="sdpa", attn_mask_type="causal"))
        self.model_args = model_args
        self.kv_context: KVContext | None = None
        self._positions = UnitPositions()
        self._layer_calls = False
        """Whether the family's blocks take a dict of masks (gpt-oss's): each gets a :class:`LayerCall`."""
        for layer_id, layer in self.layers.items():
            attention = layer.attention
            self._layer_calls = hasattr(attention, "sinks")
            attention_class = sink_attention_class if self._layer_calls else sequence_attention_class
            attention.__class__ = attention_class(type(attention))
            attention.inner_attention = DocumentAttention(int(layer_id), layer_reach(layer, model_args))
            attention.inner_attention.latent = mla_latent(attention)

    def init_weights(self, *args: Any, **kwargs: Any) -> None:
        """The family's initialisation, then every router's gate bias zeroed (see the module docstring).

        Args:
            *args: the family's ``init_weights`` arguments (``buffer_device``).
            **kwargs: likewise.
        """
        super().init_weights(*args, **kwargs)
        for module in self.modules():
            if isinstance(module, TokenChoiceTopKRouter) and module.gate.bias is not None:
                with torch.no_grad():
                    module.gate.bias.zero_()

    def get_attention_masks(self, input_batch: Tensor, tokenizer: Any, extra_inputs: Any = None) -> Tensor | None:
        """A packed batch's document ids, which block-causal flavors attend by in place of a mask.

        Every stage and every sequence schedule splits and reads the ids.

        Args:
            input_batch: (B, S) token ids.
            tokenizer: the job's tokenizer, whose EOS token ends each document.
            extra_inputs: torchtitan's other inputs, not read.

        Returns:
            (B, S) document ids (:func:`~torchtitan_seq.runtime.documents.document_ids`); None for a causal
            flex flavor.

        Raises:
            TypeError: for a causal SDPA flavor, as torchtitan's models raise it.
            ValueError: a tokenizer without an EOS token.
        """
        if (mask_type := self.model_args.attn_mask_type) != "block_causal":
            if self.model_args.attn_type == "flex":
                return None  # a causal flex flavor's (gpt-oss's), which torchtitan's trainer asks
            # TypeError, as torchtitan's models raise it: its validator takes it for "no masks" (causal)
            raise TypeError(f"attention masks asked of a flavor with attn_mask_type={mask_type!r}")
        if tokenizer.eos_id is None:
            raise ValueError("block-causal attention needs a tokenizer with an EOS token")
        return document_ids(input_batch, tokenizer.eos_id)

    def forward(self, tokens: Tensor, attention_masks: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """The family's forward, with RoPE at the unit's positions while a pipeline stage runs a unit.

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
        if self._layer_calls:
            call = LayerCall(attention_masks, positions)
            return stage_forward(self, tokens, {"basic_mask": call, "sliding_window_mask": call})
        return super().forward(tokens, attention_masks, positions)


def _changed(model_args: Any, **changes: Any) -> Any:
    """A copy of ``model_args`` with ``changes``, keeping the attributes that are no dataclass fields
    (DeepSeek-V3's ``moe_impl``, which its ``update_from_config`` sets)."""
    changed = copy.copy(model_args)
    for name, value in changes.items():
        setattr(changed, name, value)
    return changed


@functools.cache
def sequence_model_class(model_cls: type[nn.Module]) -> type[nn.Module]:
    """A torchtitan 0.2.2 model family's class whose attention can run one (microbatch, subsequence) unit
    at a time (see the module docstring).

    Args:
        model_cls: the family's model class (``Transformer`` of Llama 3, ``Qwen3Model``, ...), built from
            model args with ``attn_type`` and ``attn_mask_type`` fields.

    Returns:
        Its subclass ``Seq<name>`` (one per class), built from the same model args.
    """
    name = f"Seq{model_cls.__name__}"
    return type(name, (_SequenceModel, model_cls), {"__doc__": f"{model_cls.__name__} with chunk-aware attention."})
