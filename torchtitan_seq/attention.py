"""Chunk-aware causal attention for one unit of a subsequence pipeline.

A unit's queries cover positions [s, s+L) of the sequence; its keys are the
prefix [0, s) and its own [s, s+L), all in its microbatch's K/V slab (written by the
:class:`~torchtitan_seq.kv_context.KVContext`, the unit's own first), read as views.
A kernel that aligns causal masks at the bottom right reads slab[0 : s+L] in one causal
call; torch's kernels align them top-left, so they get two: the prefix unmasked and the
square diagonal causally, merged once by log-sum-exp. Backward makes the same calls with
the *merged* output and log-sum-exp, which is exact (the ring-attention identity): dq
once (one add of two calls), dK/dV of the prefix added in place into the slab's gradient,
which the earlier units' backward reads. The unit saves only views of the slab, q, its
output and the log-sum-exp: no concatenated K/V and no mask are ever built.

Packed documents (block-causal attention, :mod:`torchtitan_seq.documents`) keep
this shape: per batch row, each piece of a document within the unit is a causal
diagonal block, and only the queries of the document that continues into the
unit read the prefix, from that document's first key on, in one call (or in the
piece's own call, bottom-right aligned).

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
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .documents import Documents
from .kv_context import KVContext, KVSlab

__all__ = ["AttentionBackend", "AttentionKernel", "select_kernel", "SequenceAttention", "bind_kv_context"]

AttentionBackend = Literal["auto", "flash", "sdpa"]


class AttentionKernel(Protocol):
    """Block attention with log-sum-exp in torch's SDPA layout: q (B, Hq, Lq, D); k, v
    (B, Hkv, Lk, D) with Hq a multiple of Hkv. ``forward`` returns out (B, Hq, Lq, D) and
    lse (B, Hq, Lq) in float32; ``backward`` returns dq, dk, dv shaped like q, k, v.

    ``bottom_right``: a causal call with Lq < Lk aligns its mask at the bottom right (query i
    attends keys up to i + Lk - Lq), so a unit reads its prefix and its own keys in one call.
    A kernel that aligns top-left (torch's) gets square causal calls only, and the prefix in
    an unmasked call of its own: two calls per unit, merged once."""

    bottom_right: bool

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class CpuSdpaKernel:
    """torch's flash-attention kernel for the CPU (handles GQA natively; causal masks top-left)."""

    bottom_right = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )


def _expand(t: Tensor, n_rep: int) -> Tensor:
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def _reduce(t: Tensor, n_rep: int) -> Tensor:
    return t if n_rep == 1 else t.unflatten(1, (-1, n_rep)).sum(2)


class CudaSdpaKernel:
    """torch's own CUDA flash-attention kernel (fp16/bf16), used without flash-attn. It
    has no GQA support: grouped K/V heads are expanded per call, their gradients summed back.
    Causal masks align top-left."""

    bottom_right = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand(k, n_rep), _expand(v, n_rep), 0.0, causal, scale=scale
        )
        return out, lse.float()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        # None, as the forward returns them: defined sequence offsets select the varlen
        # kernel, and without dropout the RNG state is never read.
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, _expand(k, n_rep), _expand(v, n_rep), out, lse,
            None, None, q.shape[2], k.shape[2], 0.0, causal, None, None, scale=scale,
        )
        return dq, _reduce(dk, n_rep), _reduce(dv, n_rep)


class CudnnSdpaKernel:
    """torch's cuDNN attention kernel (fp16/bf16), the one torch's SDPA picks on Hopper:
    1.75x the flash kernel's speed forward + backward on an H200 at 32K tokens
    (``benchmarks/gpu/2026-11-30``). Grouped K/V heads are expanded as for the flash kernel;
    the aten op takes no mask alignment (top-left)."""

    bottom_right = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, _expand(k, n_rep), _expand(v, n_rep), None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.view(q.shape[:-1]).float()  # cuDNN's lse is (B, H, L, 1)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        # Without dropout the RNG state is not read; no sequence offsets: not the varlen kernel.
        rng = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, _expand(k, n_rep), _expand(v, n_rep), out.contiguous(), lse.unsqueeze(-1).contiguous(),
            rng, rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        return dq, _reduce(dk, n_rep), _reduce(dv, n_rep)


class FlashAttnKernel:
    """flash-attn 2 (CUDA). Its layout is (B, L, H, D); GQA is native; causal masks align at
    the bottom right when Lq < Lk (flash-attn >= 2.1)."""

    bottom_right = True

    def __init__(self) -> None:
        self._fa = importlib.import_module("flash_attn.flash_attn_interface")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = self._fa._flash_attn_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
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


def select_kernel(device: torch.device, backend: AttentionBackend = "auto") -> AttentionKernel:
    """The block kernel for ``device``. backend: ``"auto"`` (on CUDA: torch's cuDNN kernel on
    Hopper and newer, else flash-attn when importable, else torch's flash kernel; on the CPU
    torch's), ``"flash"`` (flash-attn, an error if absent) or ``"sdpa"`` (torch's kernels)."""
    if backend not in get_args(AttentionBackend):
        raise ValueError(f"sequence_pipeline.attention_backend = {backend!r}: use 'auto', 'flash' or 'sdpa'")
    if device.type != "cuda":
        if backend == "flash":
            raise ValueError(
                "sequence_pipeline.attention_backend = 'flash' needs a CUDA device; use 'sdpa' or 'auto' on the CPU"
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


def _merge(out: Tensor, lse: Tensor, out_i: Tensor, lse_i: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial attentions by their log-sum-exp."""
    new_lse = torch.logaddexp(lse, lse_i)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + out_i * torch.exp(lse_i - new_lse).unsqueeze(-1)
    return out, new_lse


@dataclass(eq=False)
class _Binding:
    """What a bound attention layer's custom op reads at run time: the stage's context and kernel."""

    context: KVContext
    kernel: AttentionKernel


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


_EVERY = slice(None)


@dataclass(frozen=True)
class _Call:
    """One kernel call of a unit: the queries q[rows, :, queries] (positions within the unit)
    attend to the keys [keys.start, keys.stop) of the sequence, causally (the mask aligned at
    the bottom right: the last query sees the last key) or not."""

    rows: slice
    queries: slice
    keys: slice
    causal: bool

    @property
    def index(self) -> tuple[slice, slice, slice]:
        """The index of q, out and lse (B, H, L[, D]) this call reads and writes."""
        return self.rows, _EVERY, self.queries


def _calls(
    documents: Documents | None, offset: int, length: int, bottom_right: bool
) -> tuple[list[_Call], list[_Call]]:
    """The kernel calls of ``length`` queries at ``offset`` under ``documents`` (None: causal):
    causal calls whose queries cover the unit once, and unmasked prefix calls over queries
    already covered, merged by log-sum-exp. Per batch row (every row at once without documents)
    each document piece inside the unit is a causal call over its own keys; the piece of the
    document continuing into the unit reads that document's prefix too: in the same call where
    the kernel aligns causal masks at the bottom right, else in one unmasked call of its own."""
    rows_pieces = (
        [(_EVERY, [(0, length)], 0)] if documents is None else
        [(slice(b, b + 1), documents.pieces(b, offset, offset + length), documents.start_of(b, offset))
         for b in range(len(documents.starts))]
    )
    causal: list[_Call] = []
    prefix: list[_Call] = []
    for rows, pieces, first in rows_pieces:
        whole = documents is None
        calls = [
            _Call(rows, _EVERY if whole else slice(a, b), slice(offset + a, offset + b), True) for a, b in pieces
        ]
        if first < offset:  # the continuing document's prefix [first, offset)
            head = calls[0]
            if bottom_right:
                calls[0] = _Call(rows, head.queries, slice(first, head.keys.stop), True)
            else:
                prefix.append(_Call(rows, head.queries, slice(first, offset), False))
        causal += calls
    return causal, prefix


@dataclass(frozen=True)
class _Keys:
    """Where a unit's keys lie: those before ``offset`` in ``slab``, the unit's own, (B, Hkv, L, D)
    from ``offset`` on, in the slab where it holds them (written there), else in ``own``."""

    own: tuple[Tensor, Tensor]
    offset: int
    slab: KVSlab | None

    def __call__(self, c: _Call) -> tuple[Tensor, Tensor]:
        """K and V of call ``c``'s keys, views."""
        if self.slab is None or not self.slab.holds(c.keys.stop):
            start, stop = c.keys.start - self.offset, c.keys.stop - self.offset
            return self.own[0][c.rows, :, start:stop], self.own[1][c.rows, :, start:stop]
        return self.slab.keys(c.keys.start, c.keys.stop, c.rows)


def _attention_forward(
    kernel: AttentionKernel, q: Tensor, keys: _Keys, causal: list[_Call], prefix: list[_Call], scale: float
) -> tuple[Tensor, Tensor]:
    """out (B, Hq, L, D) and lse (B, Hq, L) float32 of the ``causal`` and ``prefix`` calls."""
    whole = (_EVERY, _EVERY, _EVERY)
    if len(causal) == 1 and causal[0].index == whole:
        out, lse = kernel.forward(q, *keys(causal[0]), True, scale)
    else:
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        for c in causal:
            out[c.index], lse[c.index] = kernel.forward(q[c.index], *keys(c), True, scale)
    for c in prefix:
        out_i, lse_i = kernel.forward(q[c.index], *keys(c), False, scale)
        merged, lse_m = _merge(out[c.index].float(), lse[c.index], out_i.float(), lse_i)
        if c.index == whole:
            out, lse = merged.to(q.dtype), lse_m
        else:
            out[c.index], lse[c.index] = merged.to(q.dtype), lse_m
    return out, lse


def _attention_backward(
    kernel: AttentionKernel, dout: Tensor, q: Tensor, keys: _Keys, out: Tensor, lse: Tensor,
    causal: list[_Call], prefix: list[_Call], scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, and dk, dv of the unit's own keys, of :func:`_attention_forward` given its merged
    ``out`` and ``lse``; the gradient of earlier keys goes to the slab."""
    offset, slab = keys.offset, keys.slab
    length = q.shape[2]
    whole = len(causal) == 1 and causal[0].index == (_EVERY, _EVERY, _EVERY)
    if not whole:
        dq = torch.empty_like(q)
        dk, dv = (torch.empty_like(t) for t in keys.own)
    for c in causal:
        dq_i, dk_i, dv_i = kernel.backward(dout[c.index], q[c.index], *keys(c), out[c.index], lse[c.index], True, scale)
        cut = max(offset - c.keys.start, 0)  # keys before the unit: a bottom-right call's prefix
        if cut:
            slab.accumulate(dk_i[:, :, :cut], dv_i[:, :, :cut], c.rows, c.keys.start)
        own = slice(c.keys.start + cut - offset, c.keys.stop - offset)
        if whole:
            dq, dk, dv = dq_i, dk_i[:, :, cut:], dv_i[:, :, cut:]
        else:
            dq[c.index], dk[c.rows, :, own], dv[c.rows, :, own] = dq_i, dk_i[:, :, cut:], dv_i[:, :, cut:]
    for c in prefix:
        dq_i, dk_i, dv_i = kernel.backward(dout[c.index], q[c.index], *keys(c), out[c.index], lse[c.index], False, scale)
        dq[c.index] += dq_i
        slab.accumulate(dk_i, dv_i, c.rows, c.keys.start)
    later_k, later_v = slab.take(offset, length) if slab is not None else (None, None)
    if later_k is not None:
        n = later_k.shape[2]
        dk, dv = dk.contiguous(), dv.contiguous()
        dk[:, :, :n] += later_k
        dv[:, :, :n] += later_v
    return dq, dk, dv


def _heads_inner(out: Tensor) -> Tensor:
    """(B, H, L, D) laid out as (B, L, H, D) in memory: what torch's attention kernels
    mostly return, and what torchtitan's ``out.transpose(1, 2).contiguous()`` then takes
    without a copy, so the output projection saves the same storage as this op does."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _whole_sequence(q: Tensor, documents: Tensor | None) -> tuple[AttentionKernel, Documents | None]:
    """The kernel and packed documents of an unbound call (``documents`` (B, L) ids)."""
    return select_kernel(q.device), Documents.from_ids(documents)


@torch.library.custom_op("torchtitan_seq::unit_attention", mutates_args=())
def _unit_attention(
    q: Tensor, k: Tensor, v: Tensor, ids: Tensor | None, documents: Tensor | None, scale: float, compiled: bool
) -> tuple[Tensor, Tensor]:
    """Attention of the current unit over its microbatch's slab (its K/V written there first,
    except in a recomputation); outside a unit, causal attention over ``q``'s sequence. Unbound
    (``ids`` None): block-causal attention of whole packed sequences, ``documents`` (B, L) their
    ids, read only then. ``compiled``: called from a compiled graph (see :func:`_setup_context`).
    Returns out (B, Hq, L, D) and lse (B, Hq, L) float32."""
    slab, offset = None, 0
    if ids is None:
        kernel, packed = _whole_sequence(q, documents)
    else:
        context, kernel, layer_id = _bound(ids)
        unit = context.unit or context.backward_unit
        if context.unit is not None:
            slab = context.append(layer_id, k, v, with_own=kernel.bottom_right)
        elif unit is not None:  # a recomputation inside the unit's backward
            slab = context.recorded(layer_id)
        offset = unit.offset if unit is not None else 0
        packed = context.documents_of(unit)
    causal, prefix = _calls(packed, offset, q.shape[2], kernel.bottom_right)
    out, lse = _attention_forward(kernel, q, _Keys((k, v), offset, slab), causal, prefix, scale)
    return _heads_inner(out), lse.contiguous()


@torch.library.custom_op("torchtitan_seq::unit_attention_backward", mutates_args=())
def _unit_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ids: Tensor | None,
    documents: Tensor | None, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`_unit_attention`; sends the dK/dV of the prefix the unit read to its
    slab's gradient, and adds what the later units (run backward first) sent the unit's own keys."""
    slab, offset = None, 0
    if ids is None:
        kernel, packed = _whole_sequence(q, documents)
    else:
        context, kernel, layer_id = _bound(ids)
        unit = context.backward_unit
        if unit is not None:
            slab, offset = context.recorded(layer_id), unit.offset
        packed = context.documents_of(unit)
    causal, prefix = _calls(packed, offset, q.shape[2], kernel.bottom_right)
    dq, dk, dv = _attention_backward(
        kernel, dout.contiguous(), q, _Keys((k, v), offset, slab), out, lse, causal, prefix, scale
    )
    # A custom op's outputs must have the strides of its fake implementation.
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_unit_attention.register_fake
def _fake_attention(q: Tensor, *_) -> tuple[Tensor, Tensor]:
    b, h, n, d = q.shape
    return q.new_empty(b, n, h, d).transpose(1, 2), q.new_empty(q.shape[:-1], dtype=torch.float32)


@_unit_attention_backward.register_fake
def _fake_gradients(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, *_) -> tuple[Tensor, ...]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    """Saves q, the output and log-sum-exp, and the unit's K/V: in eager mode the slab's views
    where they lie (the slab is then the one copy of K/V, and the saved-tensor count sees it);
    a compiled graph saves its own k, v (the op's Python state is not traced)."""
    q, k, v, ids, documents, ctx.scale, compiled = inputs
    if ids is not None and not compiled:
        context, _, layer_id = _bound(ids)
        k, v = context.own(layer_id) or (k, v)
    ctx.save_for_backward(q, k, v, *output, ids, documents)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    """dq, dk, dv; no gradient for ids, documents, scale and compiled."""
    return *_unit_attention_backward(dout, *ctx.saved_tensors, ctx.scale), None, None, None, None


_unit_attention.register_autograd(_backward, setup_context=_setup_context)


class SequenceAttention(nn.Module):
    """Drop-in for torchtitan's ``ScaledDotProductAttentionWrapper``. Unbound, it computes
    exactly what torchtitan's Llama 3 computes: causal SDPA over the whole sequence
    (block-causal given documents, by ``torchtitan_seq::unit_attention`` without a unit).
    Bound to a stage's KV context (:meth:`bind`: after construction, as torchtitan deep-copies
    the model per pipeline stage and each stage has its own context), it runs that op on units."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.ids: Tensor | None = None  # (handle, layer id) on the CPU: see the module docstring
        self._binding: _Binding | None = None

    def bind(self, context: KVContext, kernel: AttentionKernel) -> None:
        handle = next(_HANDLES)
        _BINDINGS[handle] = self._binding = _Binding(context, kernel)
        self.ids = torch.tensor([handle, self.layer_id])

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, enable_gqa: bool = False,
        is_causal: bool = True, documents: Tensor | None = None,
    ) -> Tensor:
        """q: (B, Hq, L, D) post-RoPE; k, v: (B, Hkv, L, D) post-RoPE, before GQA expansion.
        documents: (B, L) document ids of a packed batch (block-causal attention), read
        when unbound; a bound layer reads its unit's documents from the KV context.
        Returns (B, Hq, L, D)."""
        if self.ids is None and documents is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
        if not is_causal:
            raise ValueError("SequenceAttention runs units of causal attention only")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        compiled = torch.compiler.is_compiling()
        return torch.ops.torchtitan_seq.unit_attention(q, k, v, self.ids, documents, scale, compiled)[0]


def bind_kv_context(model: nn.Module, context: KVContext, kernel: AttentionKernel) -> None:
    """Attach ``context`` and ``kernel`` to every :class:`SequenceAttention` of a model chunk,
    and the context to the chunk itself where it reads it (``model.kv_context``: RoPE at the
    unit's offset). A chunk may hold no attention layer (the output layer alone), but a model
    whose attention is not chunk-aware cannot run units."""
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
