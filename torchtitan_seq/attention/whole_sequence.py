"""The whole-sequence path: attention over whole sequences, no unit (torch's schedules, no pipeline),
causal by torch's SDPA; block-causal over packed documents, within a window or attention chunks and with
sinks by the custom op ``torchtitan_seq::whole_sequence_attention`` and its autograd: one causal call
per document (and chunk) piece at offset 0, the same calls as a unit's (:mod:`.calls`), no mask built
but a window's. Document starts are read once per batch
(:meth:`~torchtitan_seq.runtime.documents.Documents.of_batch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchtitan_seq.attention.calls import Keys, attention_backward, attention_forward, kernel_calls, sink_gradient
from torchtitan_seq.attention.kernels import AttentionKernel, select_kernel
from torchtitan_seq.attention.layouts import fake_attention, fake_gradients, heads_inner, lse_layout, sink_output
from torchtitan_seq.runtime.documents import Documents
from torchtitan_seq.runtime.reach import FULL, Reach


def whole_sequence_forward(
    kernel: AttentionKernel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    documents: Documents | None,
    scale: float,
    reach: Reach = FULL,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention over the whole sequence, block-causal given ``documents`` (one causal call
    per document piece, nothing before position 0), within ``reach``, with ``sinks`` (Hq,) where given:
    q (B, Hq, L, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv). Returns out (B, Hq, L, Dv) and lse (B, Hq, L)
    float32."""
    causal, prefix = kernel_calls(documents, ((0, q.shape[2]),), kernel.bottom_right, reach)
    return attention_forward(kernel, q, Keys((k, v), 0, None), causal, prefix, scale, sinks)


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
    reach: Reach = FULL,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (shaped like q, k, v) of :func:`whole_sequence_forward`, given its ``out`` and ``lse``
    (the sinks' gradient is :func:`~.calls.sink_gradient`'s)."""
    causal, prefix = kernel_calls(documents, ((0, q.shape[2]),), kernel.bottom_right, reach)
    return attention_backward(kernel, dout, q, Keys((k, v), 0, None), out, lse, causal, prefix, scale)


def _reach(window: int, chunk: int) -> Reach:
    """The reach the op's ints name (0: none; a custom op takes no dataclass)."""
    return Reach(window or None, chunk or None)


def _documents(ids: Tensor | None) -> Documents | None:
    """The documents of a packed batch's ids (None: causal)."""
    return None if ids is None else Documents.of_batch(ids)


@torch.library.custom_op("torchtitan_seq::whole_sequence_attention", mutates_args=())
def _whole_sequence_attention(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, scale: float, window: int, chunk: int,
    sinks: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Attention over whole sequences, no unit: q (B, Hq, L, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv),
    block-causal by ``documents`` (B, L) ids (None: causal), within a ``window`` and attention ``chunk``
    (0: none), with ``sinks`` (Hq,) where given. Returns out (B, Hq, L, Dv) and lse (B, Hq, L)."""
    reach, kernel = _reach(window, chunk), select_kernel(q.device)
    out, lse = whole_sequence_forward(kernel, q, k, v, _documents(documents), scale, reach, sinks)
    return heads_inner(out), lse_layout(lse)


@torch.library.custom_op("torchtitan_seq::whole_sequence_attention_backward", mutates_args=())
def _whole_sequence_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor,
    documents: Tensor | None, scale: float, window: int, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv (shaped like q, k, v, laid out as :func:`heads_inner` lays them out) and dsinks (empty
    without sinks) of :func:`_whole_sequence_attention`, given dout, its out and lse."""
    kernel, reach, packed = select_kernel(q.device), _reach(window, chunk), _documents(documents)
    dq, dk, dv = whole_sequence_backward(kernel, dout, q, k, v, out, lse, packed, scale, reach)
    dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
    return heads_inner(dq), heads_inner(dk), heads_inner(dv), sink_output(dsinks, q)


def _save_whole(ctx, inputs, output) -> None:
    """Saves q, k, v, the sinks, the output and log-sum-exp, and the document ids."""
    q, k, v, documents, ctx.scale, ctx.window, ctx.chunk, sinks = inputs
    ctx.save_for_backward(q, k, v, sinks, *output, documents)
    ctx.set_materialize_grads(False)


def _whole_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    """dq, dk, dv and dsinks; no gradient for the documents, scale, window and chunk."""
    sinks = ctx.saved_tensors[3]
    dq, dk, dv, dsinks = _whole_sequence_attention_backward(dout, *ctx.saved_tensors, ctx.scale, ctx.window, ctx.chunk)
    return dq, dk, dv, None, None, None, None, None if sinks is None else dsinks


_whole_sequence_attention.register_fake(fake_attention)
_whole_sequence_attention_backward.register_fake(fake_gradients)
_whole_sequence_attention.register_autograd(_whole_backward, setup_context=_save_whole)


def whole_sequence_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    documents: Tensor | None,
    scale: float | None,
    is_causal: bool,
    enable_gqa: bool,
    reach: Reach = FULL,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention over whole sequences, no unit (torch's schedules, no pipeline): torchtitan's SDPA where
    it is plain causal attention, else (packed documents' (B, L) ids, a window or attention chunks of
    ``reach``, ``sinks`` (Hq,)) ``torchtitan_seq::whole_sequence_attention`` (no mask built but a
    window's). q (B, Hq, L, D); k (B, Hkv, L, D); v (B, Hkv, L, Dv). Returns (B, Hq, L, Dv)."""
    if documents is None and reach == FULL and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
    if not is_causal:
        raise ValueError("SequenceAttention runs packed documents, windows, chunks and sinks causally only")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    window, chunk = reach.window or 0, reach.chunk or 0
    return torch.ops.torchtitan_seq.whole_sequence_attention(q, k, v, documents, scale, window, chunk, sinks)[0]
