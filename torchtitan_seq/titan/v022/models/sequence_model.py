"""A torchtitan 0.2.2 decoder LLM with chunk-aware attention: the one seam every model family goes through.

torchtitan's LLM families (Llama 3, Qwen3, ...) share a layout: ``layers`` of blocks, each with an
``attention`` module that projects the queries, keys and values (QK-norm, RoPE at ``positions`` and
the family's own head dims included) and hands them, (B, heads, L, head_dim), to its
``inner_attention`` module on the SDPA path. :func:`sequence_model_class` keeps all of that, the
parameters, FQNs, initialisation, TP plans and checkpoints the family's own, and changes two things:

- every layer's inner attention is a :class:`DocumentAttention` (a
  :class:`~torchtitan_seq.attention.SequenceAttention`), and the layer takes the SDPA path whatever
  attention type its flavor names; a block-causal flavor's (B, S) document ids reach it through the
  layer's call (the layer hands them over on each call, so a recomputation under activation
  checkpointing reads the ids it was called with);
- while a pipeline stage runs a unit at offset s, the model reads RoPE at positions [s, s+L) (a CP
  rank at its share's, :class:`~torchtitan_seq.runtime.rope.UnitPositions`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.tools.utils import has_cuda_capability

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.runtime.documents import document_ids
from torchtitan_seq.runtime.kv_context import KVContext
from torchtitan_seq.runtime.rope import UnitPositions

__all__ = ["DocumentAttention", "sequence_model_class", "sequence_attention_class"]


class DocumentAttention(SequenceAttention):
    """A :class:`~torchtitan_seq.attention.SequenceAttention` called as torchtitan 0.2.2's
    ``ScaledDotProductAttentionWrapper`` is (q, k, v, ``scale``, ``enable_gqa``), which attends by the
    document ids its layer handed it for the call (:attr:`documents`)."""

    def __init__(self, layer_id: int) -> None:
        """The inner attention of layer ``layer_id``.

        Args:
            layer_id: the layer's index, which names its slab in a stage's KV context.
        """
        super().__init__(layer_id)
        self.documents: Tensor | None = None
        """(B, L) document ids of the layer's current call; None: causal."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, enable_gqa: bool = False
    ) -> Tensor:
        """:meth:`SequenceAttention.forward <torchtitan_seq.attention.SequenceAttention.forward>` with
        the layer's document ids.

        Args:
            q: (B, Hq, L, Dqk) queries, post-RoPE.
            k: (B, Hkv, L, Dqk) keys, post-RoPE.
            v: (B, Hkv, L, Dv) values.
            scale: the softmax scale; None: Dqk ** -0.5.
            enable_gqa: SDPA's, on the unbound causal path.

        Returns:
            (B, Hq, L, Dv).
        """
        return super().forward(q, k, v, scale=scale, enable_gqa=enable_gqa, documents=self.documents)


class _DocumentsToInnerAttention(nn.Module):
    """Mixed before a family's attention class: hands the layer's document ids to its inner attention
    for the call, and takes the family's SDPA path."""

    inner_attention: DocumentAttention

    def forward(
        self, x: Tensor, rope: Tensor, attention_masks: Tensor | None, positions: Tensor | None = None
    ) -> Tensor:
        self.inner_attention.documents = attention_masks
        if isinstance(rope, DTensor) and positions is not None and not isinstance(positions, DTensor):
            # A TP plan that hands the layer a distributed RoPE table (Qwen3's) indexes it by positions
            # of the same kind, which torchtitan makes so only under its own CP.
            positions = DTensor.from_local(positions, rope.device_mesh, [Replicate()] * rope.device_mesh.ndim)
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
            model_args = dataclasses.replace(model_args, moe_args=dataclasses.replace(moe, use_grouped_mm=False))
        # The family builds SDPA layers, whose inner attention is replaced below; the flavor's own
        # attention type tells torchtitan's trainer whether to ask for attention masks.
        super().__init__(dataclasses.replace(model_args, attn_type="sdpa", attn_mask_type="causal"))
        self.model_args = model_args
        self.kv_context: KVContext | None = None
        self._positions = UnitPositions()
        for layer_id, layer in self.layers.items():
            attention = layer.attention
            attention.__class__ = sequence_attention_class(type(attention))
            attention.inner_attention = DocumentAttention(int(layer_id))

    def get_attention_masks(self, input_batch: Tensor, tokenizer: Any, extra_inputs: Any = None) -> Tensor:
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
        return super().forward(tokens, attention_masks, positions)


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
