"""The whole-sequence path: attention over whole sequences, no unit (torch's schedules, no pipeline),
causal by torch's SDPA, block-causal over packed documents by the custom op
``torchtitan_seq::document_attention`` and its autograd: one causal call per document piece at offset 0,
the same calls as a unit's (:mod:`.calls`), no mask built. Document starts are read once per batch
(:meth:`~torchtitan_seq.runtime.documents.Documents.of_batch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchtitan_seq.attention.calls import Keys, attention_backward, attention_forward, kernel_calls
from torchtitan_seq.attention.kernels import AttentionKernel, select_kernel
from torchtitan_seq.attention.layouts import fake_attention, fake_gradients, heads_inner, lse_layout
from torchtitan_seq.runtime.documents import Documents


def whole_sequence_forward(
    kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, documents: Documents | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Causal attention over the whole sequence, block-causal given ``documents`` (one causal call
    per document piece, no mask, nothing before position 0): q (B, Hq, L, D), k, v (B, Hkv, L, D).
    Returns out (B, Hq, L, D) and lse (B, Hq, L) float32."""
    causal, prefix = kernel_calls(documents, ((0, q.shape[2]),), kernel.bottom_right)
    return attention_forward(kernel, q, Keys((k, v), 0, None), causal, prefix, scale)


def whole_sequence_backward(
    kernel: AttentionKernel,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    documents: Documents | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (shaped like q, k, v) of :func:`whole_sequence_forward`, given its ``out`` and ``lse``."""
    causal, prefix = kernel_calls(documents, ((0, q.shape[2]),), kernel.bottom_right)
    return attention_backward(kernel, dout, q, Keys((k, v), 0, None), out, lse, causal, prefix, scale)


@torch.library.custom_op("torchtitan_seq::document_attention", mutates_args=())
def _document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Block-causal attention of whole packed sequences, no unit: q (B, Hq, L, D), k, v
    (B, Hkv, L, D), ``documents`` (B, L) their ids. Returns out (B, Hq, L, D) and lse (B, Hq, L)."""
    out, lse = whole_sequence_forward(select_kernel(q.device), q, k, v, Documents.of_batch(documents), scale)
    return heads_inner(out), lse_layout(lse)


@torch.library.custom_op("torchtitan_seq::document_attention_backward", mutates_args=())
def _document_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, documents: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (shaped like q, k, v, laid out as :func:`heads_inner` lays them out) of
    :func:`_document_attention`, given dout, its out and lse."""
    kernel, packed = select_kernel(q.device), Documents.of_batch(documents)
    dq, dk, dv = whole_sequence_backward(kernel, dout, q, k, v, out, lse, packed, scale)
    return heads_inner(dq), heads_inner(dk), heads_inner(dv)


def _save_documents(ctx, inputs, output) -> None:
    """Saves q, k, v, the output and log-sum-exp, and the document ids."""
    q, k, v, documents, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output, documents)
    ctx.set_materialize_grads(False)


def _documents_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    """dq, dk, dv; no gradient for documents and scale."""
    return *_document_attention_backward(dout, *ctx.saved_tensors, ctx.scale), None, None


_document_attention.register_fake(fake_attention)
_document_attention_backward.register_fake(fake_gradients)
_document_attention.register_autograd(_documents_backward, setup_context=_save_documents)


def whole_sequence_attention(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, scale: float | None, is_causal: bool, enable_gqa: bool
) -> Tensor:
    """Attention over whole sequences, no unit (torch's schedules, no pipeline): torchtitan's SDPA,
    or, given ``documents`` (B, L) ids, block-causal attention by ``torchtitan_seq::document_attention``
    (no mask built). q (B, Hq, L, D); k, v (B, Hkv, L, D). Returns (B, Hq, L, D)."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
    if not is_causal:
        raise ValueError("SequenceAttention runs packed documents block-causally only")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.torchtitan_seq.document_attention(q, k, v, documents, scale)[0]
