"""Chunk-aware causal attention for one unit of a subsequence pipeline.

A unit's queries cover positions [s, s+L) of the sequence; its keys are the
prefix [0, s) held by the :class:`~torchtitan_seq.kv_context.KVContext` plus its
own [s, s+L). The prefix is read block by block where it lies (one kernel call
per earlier unit, unmasked) and the diagonal block causally (it is square, so
top-left and bottom-right alignment agree); the partial results are merged by
log-sum-exp. Backward calls the kernel's backward per block with the *merged*
output and log-sum-exp, which is exact (the ring-attention identity), so the
unit saves only references and the log-sum-exp: no concatenated K/V and no
mask are ever built.

Packed documents (block-causal attention, :mod:`torchtitan_seq.documents`) keep
this shape: per batch row, each piece of a document within the unit is a causal
diagonal block, and only the queries of the document that continues into the
unit read the prefix, from that document's first key on. Prefix blocks of
earlier documents are neither computed nor read.

Kernels: torch's cuDNN kernel on Hopper GPUs, flash-attn on other GPUs when installed,
torch's SDPA kernels otherwise (``aten._scaled_dot_product_flash_attention_for_cpu`` on
the CPU).

The unit's attention is the custom op ``torchtitan_seq::unit_attention`` with a
backward op of its own: torch.compile keeps it out of the compiled graph, so the KV
context (Python state) is read and changed when the op runs, never traced. A layer
names its context by a small CPU tensor of ids, a graph input, so one compiled graph
serves every layer of a model.
"""

from __future__ import annotations

import importlib
import itertools
import weakref
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .documents import Documents
from .kv_context import KVBlock, KVContext, Unit

__all__ = ["AttentionKernel", "select_kernel", "SequenceAttention", "bind_kv_context"]


class AttentionKernel(Protocol):
    """Block attention with log-sum-exp; shapes are torch's SDPA layout.

    q: (B, Hq, Lq, D); k, v: (B, Hkv, Lk, D) with Hq a multiple of Hkv.
    ``forward`` returns out (B, Hq, Lq, D) and lse (B, Hq, Lq) in float32;
    ``backward`` returns dq, dk, dv shaped like q, k, v.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class CpuSdpaKernel:
    """torch's flash-attention kernel for the CPU (handles GQA natively)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.float()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )


class CudaSdpaKernel:
    """torch's own CUDA flash-attention kernel (fp16/bf16), used without flash-attn.

    It has no GQA support, so grouped K/V heads are expanded per call and their
    gradients summed back.
    """

    @staticmethod
    def _expand(t: torch.Tensor, n_rep: int) -> torch.Tensor:
        return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)

    @staticmethod
    def _reduce(t: torch.Tensor, n_rep: int) -> torch.Tensor:
        if n_rep == 1:
            return t
        b, h, l, d = t.shape
        return t.view(b, h // n_rep, n_rep, l, d).sum(2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, self._expand(k, n_rep), self._expand(v, n_rep), 0.0, causal, scale=scale
        )
        return out, lse.float()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        # None, as the forward returns them: defined sequence offsets select the varlen
        # kernel, and without dropout the RNG state is never read.
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, self._expand(k, n_rep), self._expand(v, n_rep), out, lse,
            None, None, q.shape[2], k.shape[2], 0.0, causal, None, None, scale=scale,
        )
        return dq, self._reduce(dk, n_rep), self._reduce(dv, n_rep)


class CudnnSdpaKernel(CudaSdpaKernel):
    """torch's cuDNN attention kernel (fp16/bf16), the one torch's SDPA picks on Hopper:
    1.75x the flash kernel's speed forward + backward on an H200 at 32K tokens
    (``benchmarks/gpu/2026-11-30``). Grouped K/V heads are expanded as for the flash kernel."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, self._expand(k, n_rep), self._expand(v, n_rep), None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.view(q.shape[:-1]).float()  # cuDNN's lse is (B, H, L, 1)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        # Without dropout the RNG state is not read; no sequence offsets: not the varlen kernel.
        rng = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, self._expand(k, n_rep), self._expand(v, n_rep), out.contiguous(), lse.unsqueeze(-1).contiguous(),
            rng, rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        return dq, self._reduce(dk, n_rep), self._reduce(dv, n_rep)


class FlashAttnKernel:
    """flash-attn 2 (CUDA). Its layout is (B, L, H, D); GQA is native."""

    def __init__(self) -> None:
        self._fa = importlib.import_module("flash_attn.flash_attn_interface")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = self._fa._flash_attn_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False,
        )
        return out.transpose(1, 2), lse.float()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
        self._fa._flash_attn_backward(
            t(dout).contiguous(), t(q), t(k), t(v), t(out).contiguous(), lse.contiguous(),
            dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False, rng_state=None,
        )
        return t(dq), t(dk), t(dv)


def select_kernel(device: torch.device, backend: str = "auto") -> AttentionKernel:
    """Pick the block kernel for ``device``.

    backend: ``"auto"`` (on CUDA: torch's cuDNN kernel on Hopper and newer, else
    flash-attn when importable, else torch's flash kernel), ``"flash"`` (flash-attn, an
    error if absent) or ``"sdpa"`` (torch's kernels: cuDNN on Hopper and newer, else flash).
    """
    if backend not in ("auto", "flash", "sdpa"):
        raise ValueError(
            f"sequence_pipeline.attention_backend = {backend!r}: use 'auto', 'flash' or 'sdpa'"
        )
    if device.type != "cuda":
        if backend == "flash":
            raise ValueError(
                "sequence_pipeline.attention_backend = 'flash' needs a CUDA device; "
                "use 'sdpa' or 'auto' on the CPU"
            )
        return CpuSdpaKernel()
    hopper = torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)
    if backend == "flash" or (backend == "auto" and not hopper):
        try:
            return FlashAttnKernel()
        except ImportError:
            if backend == "flash":
                raise ValueError(
                    "sequence_pipeline.attention_backend = 'flash' but flash-attn is not "
                    "installed: `pip install 'torchtitan_seq[gpu]'`, or set it to 'sdpa'"
                ) from None
    return CudnnSdpaKernel() if hopper else CudaSdpaKernel()


def _merge(out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor):
    """Combine two softmax-normalised partial attentions by their log-sum-exp."""
    new_lse = torch.logaddexp(lse, lse_i)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + out_i * torch.exp(lse_i - new_lse).unsqueeze(-1)
    return out, new_lse


class _Binding:
    """What a bound attention layer's custom op reads at run time: the stage's context and kernel."""

    __slots__ = ("context", "kernel", "__weakref__")

    def __init__(self, context: KVContext, kernel: AttentionKernel) -> None:
        self.context, self.kernel = context, kernel


# Custom ops take no Python objects: a bound layer passes a handle to its binding.
_BINDINGS: weakref.WeakValueDictionary[int, _Binding] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def _bound(ids: Tensor) -> tuple[KVContext, AttentionKernel, int]:
    """The context, kernel and layer id behind a layer's ``ids``."""
    handle, layer_id = ids.tolist()
    binding = _BINDINGS.get(handle)
    if binding is None:
        raise RuntimeError(
            f"unit attention of layer {layer_id}: its SequenceAttention module is gone or rebound; "
            "keep the model alive (and bound) until its graphs have run backward"
        )
    return binding.context, binding.kernel, layer_id


_Diagonal = tuple[slice, int, int]
"""(batch rows, start, stop): causal attention of the unit's queries [start, stop) to its keys there."""
_Rectangle = tuple[slice, int, KVBlock, int, int]
"""(batch rows, query stop, block, key start, key stop): the unit's queries [0, query stop)
to the block's keys [key start, key stop), indices within the block."""


def _reads(unit: Unit | None, documents: Documents | None, length: int, prefix: list[KVBlock]) -> tuple[
    list[_Diagonal], list[_Rectangle]
]:
    """What a unit of ``length`` queries attends to: its diagonal blocks and its prefix rectangles."""
    rows = slice(None)
    if documents is None:
        return [(rows, 0, length)], [(rows, length, p, 0, p.k.shape[2]) for p in prefix]
    offset = unit.offset
    diagonal: list[_Diagonal] = []
    rectangles: list[_Rectangle] = []
    for b in range(documents.batch):
        rows = slice(b, b + 1)
        pieces = documents.pieces(b, offset, offset + length)
        diagonal += [(rows, start, stop) for start, stop in pieces]
        first = documents.start_of(b, offset)
        rectangles += [
            (rows, pieces[0][1], p, max(first - p.offset, 0), p.k.shape[2]) for p in prefix if p.end > first
        ]
    return diagonal, rectangles


def _diagonal_forward(
    kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, diagonal: list[_Diagonal], scale: float
) -> tuple[Tensor, Tensor]:
    """out (B, Hq, L, D) and lse (B, Hq, L) of the causal ``diagonal`` pieces, which cover the unit."""
    if len(diagonal) == 1:
        return kernel.forward(q, k, v, True, scale)
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
    for rows, a, e in diagonal:
        out[rows, :, a:e], lse[rows, :, a:e] = kernel.forward(
            q[rows, :, a:e], k[rows, :, a:e], v[rows, :, a:e], True, scale
        )
    return out, lse


def _diagonal_backward(
    kernel: AttentionKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    diagonal: list[_Diagonal], scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of the causal ``diagonal`` pieces, given the unit's merged ``out`` and ``lse``."""
    if len(diagonal) == 1:
        return kernel.backward(dout, q, k, v, out, lse, True, scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rows, a, e in diagonal:
        dq[rows, :, a:e], dk[rows, :, a:e], dv[rows, :, a:e] = kernel.backward(
            dout[rows, :, a:e], q[rows, :, a:e], k[rows, :, a:e], v[rows, :, a:e],
            out[rows, :, a:e], lse[rows, :, a:e], True, scale,
        )
    return dq, dk, dv


def _contiguous(*tensors: Tensor) -> tuple[Tensor, ...]:
    # A custom op's outputs must have the strides of its fake implementation.
    return tuple(t.contiguous() for t in tensors)


def _heads_inner(out: Tensor) -> Tensor:
    """(B, H, L, D) laid out as (B, L, H, D) in memory: what torch's attention kernels
    mostly return, and what torchtitan's ``out.transpose(1, 2).contiguous()`` then takes
    without a copy, so the output projection saves the same storage as this op does."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@torch.library.custom_op("torchtitan_seq::unit_attention", mutates_args=())
def _unit_attention(
    q: Tensor, k: Tensor, v: Tensor, ids: Tensor, scale: float, compiled: bool
) -> tuple[Tensor, Tensor]:
    """Attention of the current unit over its prefix blocks and its own causal block
    (with packed documents: the pieces and prefix keys of :func:`_reads`).

    Outside a unit (and outside a recomputation) it is causal attention over ``q``'s
    sequence. Returns out (B, Hq, L, D) and lse (B, Hq, L) float32.
    """
    context, kernel, layer_id = _bound(ids)
    unit = context.active_unit
    if unit is None:
        prefix = []
    elif context.recomputing:
        prefix, _ = context.recorded(layer_id)
    else:
        # A compiled graph may reuse the buffers of its intermediates once this op
        # returns; the block that later units read must own its K/V.
        prefix, _ = context.append(layer_id, k.clone() if compiled else k, v.clone() if compiled else v, compiled)
    documents = context.documents_of(unit) if unit is not None else None
    diagonal, rectangles = _reads(unit, documents, q.shape[2], prefix)
    out, lse = _diagonal_forward(kernel, q, k, v, diagonal, scale)
    if rectangles:
        out = out.float()
        for rows, stop, p, a, e in rectangles:
            out_i, lse_i = kernel.forward(q[rows, :, :stop], p.k[rows, :, a:e], p.v[rows, :, a:e], False, scale)
            out[rows, :, :stop], lse[rows, :, :stop] = _merge(
                out[rows, :, :stop], lse[rows, :, :stop], out_i.float(), lse_i
            )
        out = out.to(q.dtype)
    return _heads_inner(out), lse.contiguous()


@_unit_attention.register_fake
def _(q, k, v, ids, scale, compiled):
    b, h, n, d = q.shape
    return q.new_empty(b, n, h, d).transpose(1, 2), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchtitan_seq::unit_attention_backward", mutates_args=())
def _unit_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    ids: Tensor, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`_unit_attention`; sends dK/dV to the prefix blocks the unit read.

    Per microbatch and stage the units run backward last first, so a unit's own block
    has received every later unit's dK/dV by now (``KVGrads.take``).
    """
    context, kernel, layer_id = _bound(ids)
    dout = dout.contiguous()
    unit = context.active_unit if context.in_backward else None
    prefix, grads = context.recorded(layer_id) if unit is not None else ([], None)
    documents = context.documents_of(unit) if unit is not None else None
    diagonal, rectangles = _reads(unit, documents, q.shape[2], prefix)
    dq, dk, dv = _diagonal_backward(kernel, dout, q, k, v, out, lse, diagonal, scale)
    for rows, stop, p, a, e in rectangles:
        dq_i, dk_i, dv_i = kernel.backward(
            dout[rows, :, :stop], q[rows, :, :stop], p.k[rows, :, a:e], p.v[rows, :, a:e],
            out[rows, :, :stop], lse[rows, :, :stop], False, scale,
        )
        dq[rows, :, :stop] += dq_i
        p.accumulate(dk_i, dv_i, () if dk_i.shape == p.k.shape else (rows, slice(None), slice(a, e)))
    if grads is None:
        return _contiguous(dq, dk, dv)
    later_k, later_v = grads.take()
    if later_k is not None:
        dk, dv = dk + later_k, dv + later_v
    return _contiguous(dq, dk, dv)


@_unit_attention_backward.register_fake
def _(dout, q, k, v, out, lse, ids, scale):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, ids, ctx.scale, _compiled = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, ids)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse, ids = ctx.saved_tensors
    dq, dk, dv = torch.ops.torchtitan_seq.unit_attention_backward(
        dout, q, k, v, out, lse, ids, ctx.scale
    )
    return dq, dk, dv, None, None, None


_unit_attention.register_autograd(_backward, setup_context=_setup_context)


def _document_pieces(documents: Tensor) -> list[_Diagonal]:
    """The causal pieces of whole packed sequences, from their (B, S) document ids."""
    layout = Documents.from_ids(documents)
    seq_len = documents.shape[1]
    return [(slice(b, b + 1), a, e) for b in range(layout.batch) for a, e in layout.pieces(b, 0, seq_len)]


@torch.library.custom_op("torchtitan_seq::document_attention", mutates_args=())
def _document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Block-causal attention of whole packed sequences (no pipeline unit): causal within
    each document piece, one kernel call a piece, no mask. documents: (B, L) ids.
    Returns out (B, Hq, L, D) and lse (B, Hq, L) float32."""
    out, lse = _diagonal_forward(select_kernel(q.device), q, k, v, _document_pieces(documents), scale)
    return _heads_inner(out), lse.contiguous()


@_document_attention.register_fake
def _(q, k, v, documents, scale):
    b, h, n, d = q.shape
    return q.new_empty(b, n, h, d).transpose(1, 2), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchtitan_seq::document_attention_backward", mutates_args=())
def _document_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, documents: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`_document_attention`."""
    kernel, pieces = select_kernel(q.device), _document_pieces(documents)
    return _contiguous(*_diagonal_backward(kernel, dout.contiguous(), q, k, v, out, lse, pieces, scale))


@_document_attention_backward.register_fake
def _(dout, q, k, v, out, lse, documents, scale):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _document_setup_context(ctx, inputs, output) -> None:
    q, k, v, documents, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output, documents)


def _document_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    dq, dk, dv = torch.ops.torchtitan_seq.document_attention_backward(dout, *ctx.saved_tensors, ctx.scale)
    return dq, dk, dv, None, None


_document_attention.register_autograd(_document_backward, setup_context=_document_setup_context)


class SequenceAttention(nn.Module):
    """Drop-in for torchtitan's ``ScaledDotProductAttentionWrapper``.

    Unbound, it computes exactly what torchtitan's Llama 3 computes: causal SDPA over
    the whole sequence. Bound to a stage's KV context (:meth:`bind`), it runs the
    custom op ``torchtitan_seq::unit_attention``: the unit's attention over the
    prefix the context holds, or causal attention over the input outside a unit.
    The op is the boundary that torch.compile does not trace: the context's state
    lives in Python, read when the op runs, never in a graph. The context and the
    kernel are bound after construction because torchtitan deep-copies the model per
    pipeline stage and each stage has its own context.
    """

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        # (handle, layer id) on the CPU: a tensor, not int attributes, so that torch.compile
        # gives every layer of a model one graph instead of a graph per layer
        self.ids: Tensor | None = None
        self._binding: _Binding | None = None

    def bind(self, context: KVContext | None, kernel: AttentionKernel | None) -> None:
        if context is None:
            self.ids = self._binding = None
            return
        self._binding = _Binding(context, kernel)
        handle = next(_HANDLES)
        _BINDINGS[handle] = self._binding
        self.ids = torch.tensor([handle, self.layer_id])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: (B, Hq, L, D) post-RoPE; k, v: (B, Hkv, L, D) post-RoPE, before GQA expansion.
        documents: (B, L) document ids of a packed batch (block-causal attention), read
        when unbound; a bound layer reads its unit's documents from the KV context.
        Returns (B, Hq, L, D)."""
        if self.ids is None and documents is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
        if not is_causal:
            raise ValueError("SequenceAttention runs units of causal attention only")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.ids is None:
            out, _ = torch.ops.torchtitan_seq.document_attention(q, k, v, documents, scale)
            return out
        out, _ = torch.ops.torchtitan_seq.unit_attention(
            q, k, v, self.ids, scale, torch.compiler.is_compiling()
        )
        return out


def bind_kv_context(model: nn.Module, context: KVContext | None, kernel: AttentionKernel | None) -> int:
    """Attach ``context`` (and the attention kernel) to every :class:`SequenceAttention` of a
    model chunk, and to the chunk itself where it reads the context (RoPE at the unit's
    offset: ``model.kv_context``). Returns the number of attention layers bound.

    A chunk may hold no attention layer (a pipeline's last chunk may be the
    output layer alone), but a model whose attention is not chunk-aware cannot
    run units.
    """
    layers = [m for m in model.modules() if isinstance(m, SequenceAttention)]
    if not layers and not hasattr(model, "kv_context"):
        raise TypeError(
            f"{type(model).__name__} has no chunk-aware attention: sequence schedules need "
            "[model] name = \"llama3_seq\" (or SequenceAttention layers in a model of your own)"
        )
    for m in layers:
        m.bind(context, kernel)
    if hasattr(model, "kv_context"):
        model.kv_context = context
    return len(layers)
