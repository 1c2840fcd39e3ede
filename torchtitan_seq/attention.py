"""Chunk-aware causal attention for one unit of a subsequence pipeline.

A unit's queries cover positions [s, s+L) of the sequence; its keys are the
prefix [0, s) held by the :class:`~torchtitan_seq.kv_context.KVContext` plus its
own [s, s+L). The prefix is read block by block where it lies (one unmasked kernel
call per earlier unit) and the diagonal block causally (it is square, so top-left
and bottom-right alignment agree); the partial results are merged by log-sum-exp.
Backward calls the kernel's backward per block with the *merged* output and
log-sum-exp, which is exact (the ring-attention identity), so the unit saves only
references and the log-sum-exp: no concatenated K/V and no mask are ever built.

Packed documents (block-causal attention, :mod:`torchtitan_seq.documents`) keep
this shape: per batch row, each piece of a document within the unit is a causal
diagonal block, and only the queries of the document that continues into the
unit read the prefix, from that document's first key on.

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
from .kv_context import KVBlock, KVContext, Unit

__all__ = ["AttentionBackend", "AttentionKernel", "select_kernel", "SequenceAttention", "bind_kv_context"]

AttentionBackend = Literal["auto", "flash", "sdpa"]


class AttentionKernel(Protocol):
    """Block attention with log-sum-exp in torch's SDPA layout: q (B, Hq, Lq, D); k, v
    (B, Hkv, Lk, D) with Hq a multiple of Hkv. ``forward`` returns out (B, Hq, Lq, D) and
    lse (B, Hq, Lq) in float32; ``backward`` returns dq, dk, dv shaped like q, k, v."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class CpuSdpaKernel:
    """torch's flash-attention kernel for the CPU (handles GQA natively)."""

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
    has no GQA support: grouped K/V heads are expanded per call, their gradients summed back."""

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
    (``benchmarks/gpu/2026-11-30``). Grouped K/V heads are expanded as for the flash kernel."""

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
    """flash-attn 2 (CUDA). Its layout is (B, L, H, D); GQA is native."""

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


_Index = tuple[slice, slice, slice]
"""(batch rows, heads, positions): an index of q, k, v, out and lse."""
_Rectangle = tuple[_Index, KVBlock, _Index]
"""(queries, block, keys): the unit's queries q[queries] attend to the block's keys block.k[keys]."""


def _reads(
    documents: Documents | None, unit: Unit | None, length: int, prefix: list[KVBlock]
) -> tuple[list[_Index], list[_Rectangle]]:
    """What ``length`` queries attend to: the diagonal pieces, each causal (a query attends to
    the keys at its own index), and the prefix rectangles; those of ``unit`` (None: a whole
    sequence) under ``documents`` (None: causal attention)."""
    every = slice(None)
    if documents is None:
        whole = (every, every, every)
        return [whole], [(whole, p, whole) for p in prefix]
    offset = unit.offset if unit is not None else 0
    diagonal: list[_Index] = []
    rectangles: list[_Rectangle] = []
    for b in range(len(documents.starts)):
        rows = slice(b, b + 1)
        pieces = documents.pieces(b, offset, offset + length)
        diagonal += [(rows, every, slice(start, stop)) for start, stop in pieces]
        first = documents.start_of(b, offset)
        rectangles += [
            ((rows, every, slice(pieces[0][1])), p, (rows, every, slice(max(first - p.offset, 0), p.k.shape[2])))
            for p in prefix if p.end > first
        ]
    return diagonal, rectangles


def _diagonal_forward(
    kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, diagonal: list[_Index], scale: float
) -> tuple[Tensor, Tensor]:
    """out (B, Hq, L, D) and lse (B, Hq, L) of the causal ``diagonal`` pieces, which cover the unit."""
    if len(diagonal) == 1:
        return kernel.forward(q, k, v, True, scale)
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
    for piece in diagonal:
        out[piece], lse[piece] = kernel.forward(q[piece], k[piece], v[piece], True, scale)
    return out, lse


def _diagonal_backward(
    kernel: AttentionKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    diagonal: list[_Index], scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of the causal ``diagonal`` pieces, given the unit's merged ``out`` and ``lse``."""
    if len(diagonal) == 1:
        return kernel.backward(dout, q, k, v, out, lse, True, scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for piece in diagonal:
        dq[piece], dk[piece], dv[piece] = kernel.backward(*(t[piece] for t in (dout, q, k, v, out, lse)), True, scale)
    return dq, dk, dv


def _heads_inner(out: Tensor) -> Tensor:
    """(B, H, L, D) laid out as (B, L, H, D) in memory: what torch's attention kernels
    mostly return, and what torchtitan's ``out.transpose(1, 2).contiguous()`` then takes
    without a copy, so the output projection saves the same storage as this op does."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@torch.library.custom_op("torchtitan_seq::unit_attention", mutates_args=())
def _unit_attention(
    q: Tensor, k: Tensor, v: Tensor, ids: Tensor | None, documents: Tensor | None, scale: float, compiled: bool
) -> tuple[Tensor, Tensor]:
    """Attention of the current unit over what :func:`_reads` names; outside a unit (and a
    recomputation), causal attention over ``q``'s sequence. Unbound (``ids`` None): block-causal
    attention of whole packed sequences, ``documents`` (B, L) their ids, read only then.
    Returns out (B, Hq, L, D) and lse (B, Hq, L) float32."""
    if ids is None:
        kernel, unit, prefix, packed = select_kernel(q.device), None, [], Documents.from_ids(documents)
    else:
        context, kernel, layer_id = _bound(ids)
        unit = context.unit or context.backward_unit
        if unit is None:
            prefix = []
        elif context.unit is None:  # a recomputation inside the unit's backward
            prefix, _ = context.recorded(layer_id)
        else:
            prefix, _ = context.append(layer_id, k, v, copy=compiled)
        packed = context.documents_of(unit)
    diagonal, rectangles = _reads(packed, unit, q.shape[2], prefix)
    out, lse = _diagonal_forward(kernel, q, k, v, diagonal, scale)
    if rectangles:
        out = out.float()
        for queries, p, keys in rectangles:
            out_i, lse_i = kernel.forward(q[queries], p.k[keys], p.v[keys], False, scale)
            out[queries], lse[queries] = _merge(out[queries], lse[queries], out_i.float(), lse_i)
        out = out.to(q.dtype)
    return _heads_inner(out), lse.contiguous()


@torch.library.custom_op("torchtitan_seq::unit_attention_backward", mutates_args=())
def _unit_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ids: Tensor | None,
    documents: Tensor | None, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`_unit_attention`; sends dK/dV to the prefix blocks the unit read,
    and adds those the later units (run backward first) sent the unit's own block."""
    if ids is None:
        kernel, unit, prefix, grads, packed = select_kernel(q.device), None, [], None, Documents.from_ids(documents)
    else:
        context, kernel, layer_id = _bound(ids)
        unit = context.backward_unit
        prefix, grads = context.recorded(layer_id) if unit is not None else ([], None)
        packed = context.documents_of(unit)
    dout = dout.contiguous()
    diagonal, rectangles = _reads(packed, unit, q.shape[2], prefix)
    dq, dk, dv = _diagonal_backward(kernel, dout, q, k, v, out, lse, diagonal, scale)
    for queries, p, keys in rectangles:
        dq_i, dk_i, dv_i = kernel.backward(
            dout[queries], q[queries], p.k[keys], p.v[keys], out[queries], lse[queries], False, scale
        )
        dq[queries] += dq_i
        p.accumulate(dk_i, dv_i, () if dk_i.shape == p.k.shape else keys)
    later_k, later_v = grads.take() if grads is not None else (None, None)
    if later_k is not None:
        dk, dv = dk + later_k, dv + later_v
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
    q, k, v, ids, documents, ctx.scale, _ = inputs
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
