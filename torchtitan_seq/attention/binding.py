"""Binding a model's attention to a stage's KV context: :class:`SequenceAttention`, the attention layer a
model with chunk-aware attention holds, and :func:`bind_kv_context`, which binds every such layer of a
model chunk.

Custom ops take no Python objects: a bound layer names its binding (the stage's context, its kernel and
the layer's id) by a small host tensor of its own, ``ids``, a graph input, so one compiled graph serves
every layer of a model; the op (``torchtitan_seq::unit_attention``, registered by the package) finds the
binding by the tensor's address (:func:`.handles.binding_of`), never reading the tensor. In eager mode the
layer passes its binding itself to :class:`~.unit_op.UnitAttention`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from torchtitan_seq.attention.handles import BINDINGS, LayerBinding
from torchtitan_seq.attention.kernels import AttentionKernel
from torchtitan_seq.attention.latent import LatentSource, latent_unit_attention
from torchtitan_seq.attention.unit_op import apply_unit_attention
from torchtitan_seq.attention.whole_sequence import whole_sequence_attention
from torchtitan_seq.runtime.kv_context import KVContext
from torchtitan_seq.runtime.reach import FULL, Reach
from torchtitan_seq.runtime.torch_internals import dispatch_mode_active

__all__ = ["SequenceAttention", "bind_kv_context"]


class SequenceAttention(nn.Module):
    """Drop-in for torchtitan's ``ScaledDotProductAttentionWrapper``. Unbound, it computes
    exactly what torchtitan's Llama 3 computes: causal SDPA over the whole sequence
    (block-causal given documents, by ``torchtitan_seq::whole_sequence_attention``).
    Bound to a stage's KV context (:meth:`bind`: after construction, as torchtitan deep-copies
    the model per pipeline stage and each stage has its own context), it runs
    ``torchtitan_seq::unit_attention`` on the units the context announces.

    Args:
        layer_id: the layer's index in the model, which names its K/V in the KV context.
        reach: how far back the layer's queries read (a sliding window, attention chunks); default
            every earlier key.
    """

    def __init__(self, layer_id: int, reach: Reach = FULL) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.reach = reach
        self.ids: Tensor | None = None  # names the binding, on the host: see the module docstring
        self._binding: LayerBinding | None = None
        self.latent: LatentSource | None = None
        """An MLA layer's latent and up-projection, which a context of mode ``"latent"`` keeps and expands
        (:mod:`~torchtitan_seq.attention.latent`); None: the layer's K/V are kept."""

    def bind(self, context: KVContext, kernel: AttentionKernel) -> None:
        """Bind the layer to ``context``: it then runs that context's units with ``kernel`` (see
        :func:`bind_kv_context`)."""
        self.ids = torch.tensor([self.layer_id], device="cpu")  # a storage of its own, whose address is the handle
        BINDINGS[self.ids.data_ptr()] = self._binding = LayerBinding(context, kernel, self.layer_id, self.reach)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        documents: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Attention of ``q`` over ``k`` and ``v``: a bound layer's over the unit its KV context runs (under
        context parallelism q, k and v are this rank's share of it; outside a unit, causal over what it
        is given), an unbound layer's over the whole sequence.

        Args:
            q: (B, Hq, L, D) queries, post-RoPE; under a TP plan that keeps them distributed, a DTensor
                sharded on the heads (then k, v, the sinks and the output are too).
            k: (B, Hkv, L, D) keys, post-RoPE, before GQA expansion.
            v: (B, Hkv, L, Dv) values, before GQA expansion (Dv may be narrower than D: MLA's).
            scale: the softmax scale; None: D ** -0.5.
            enable_gqa: SDPA's, on the unbound causal path; units and packed documents take grouped
                K/V heads (Hq a multiple of Hkv) as they are.
            is_causal: must be True for a bound layer and for packed documents.
            documents: (B, L) document ids of a packed batch (block-causal attention), read when
                unbound; a bound layer reads its unit's documents from the KV context.
            sinks: (Hq,) attention sinks (gpt-oss's): per head the logit of a key of value zero, which
                every query reads; merged once over all the keys the query reads.

        Returns:
            (B, Hq, L, Dv).
        """
        if isinstance(q, DTensor):
            # A TP plan that keeps the heads distributed (Qwen3's): heads attend apart, each rank its own.
            local = SequenceAttention.forward(
                self,
                q.to_local(),
                k.to_local(),
                v.to_local(),
                scale=scale,
                enable_gqa=enable_gqa,
                is_causal=is_causal,
                documents=documents,
                sinks=sinks.to_local() if isinstance(sinks, DTensor) else sinks,
            )
            return DTensor.from_local(local, q.device_mesh, q.placements, run_check=False)
        latent = self.latent.take() if self.latent is not None else None  # taken every call: held by none
        if self.ids is None:
            return whole_sequence_attention(q, k, v, documents, scale, is_causal, enable_gqa, self.reach, sinks)
        if not is_causal:
            raise ValueError("SequenceAttention runs units of causal attention only")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        context = self._binding.context
        if latent is not None and context.mode == "latent" and context.unit is not None:
            return latent_unit_attention(q, k, v, latent, self.latent, self._binding, scale)
        compiled = torch.compiler.is_compiling()
        if compiled or dispatch_mode_active():  # the custom op: see UnitAttention
            return torch.ops.torchtitan_seq.unit_attention(q, k, v, self.ids, scale, compiled, sinks)[0]
        return apply_unit_attention(q, k, v, self._binding, scale, sinks)


def bind_kv_context(model: nn.Module, context: KVContext, kernel: AttentionKernel) -> None:
    """Attach ``context`` and ``kernel`` to every :class:`SequenceAttention` of a model chunk,
    and the context to the chunk itself where it reads it (``model.kv_context``: RoPE at the
    unit's offset). A chunk may hold no attention layer (the output layer alone), but a model
    whose attention is not chunk-aware cannot run units.

    Args:
        model: the model chunk a pipeline stage runs.
        context: the stage's KV context.
        kernel: the block attention kernel the layers call.

    Raises:
        TypeError: where the chunk has neither a :class:`SequenceAttention` nor a ``kv_context``.
    """
    layers = [m for m in model.modules() if isinstance(m, SequenceAttention)]
    if not layers and not hasattr(model, "kv_context"):
        raise TypeError(
            f"{type(model).__name__} has no chunk-aware attention: sequence schedules need "
            '[model] name = "llama3_seq" (or SequenceAttention layers in a model of your own)'
        )
    for m in layers:
        m.bind(context, kernel)
    if hasattr(model, "kv_context"):
        model.kv_context = context
