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

Kernels: flash-attn on CUDA when installed, torch's SDPA kernels otherwise
(``aten._scaled_dot_product_flash_attention_for_cpu`` on the CPU).
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kv_context import KVBlock, KVContext

__all__ = ["AttentionKernel", "select_kernel", "SequenceAttention", "unit_attention", "bind_kv_context"]


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

    backend: ``"auto"`` (flash-attn on CUDA when importable, SDPA otherwise),
    ``"flash"`` (flash-attn, an error if absent) or ``"sdpa"``.
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
    if backend in ("auto", "flash"):
        try:
            return FlashAttnKernel()
        except ImportError:
            if backend == "flash":
                raise ValueError(
                    "sequence_pipeline.attention_backend = 'flash' but flash-attn is not "
                    "installed: `pip install 'torchtitan_seq[gpu]'`, or set it to 'sdpa'"
                ) from None
    return CudaSdpaKernel()


def _merge(out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor):
    """Combine two softmax-normalised partial attentions by their log-sum-exp."""
    new_lse = torch.logaddexp(lse, lse_i)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + out_i * torch.exp(lse_i - new_lse).unsqueeze(-1)
    return out, new_lse


class _UnitAttention(torch.autograd.Function):
    """Attention of one unit over its prefix blocks and its own (causal) block."""

    @staticmethod
    def forward(ctx, q, k, v, block: KVBlock, prefix: list[KVBlock], kernel: AttentionKernel, scale: float):
        out, lse = kernel.forward(q, k, v, True, scale)
        if prefix:
            out = out.float()
            for p in prefix:
                out_i, lse_i = kernel.forward(q, p.k, p.v, False, scale)
                out, lse = _merge(out, lse, out_i.float(), lse_i)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block, ctx.prefix, ctx.kernel, ctx.scale = block, prefix, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, scale = ctx.kernel, ctx.scale
        dout = dout.contiguous()
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale)
        for p in ctx.prefix:
            dq_i, dk_i, dv_i = kernel.backward(dout, q, p.k, p.v, out, lse, False, scale)
            dq = dq + dq_i
            p.accumulate(dk_i, dv_i)
        later_k, later_v = ctx.block.take_grads()
        # A graph can outlive its backward (torch keeps the last stage's losses
        # until the step ends): let go of the K/V blocks now.
        ctx.block = ctx.prefix = None
        if later_k is not None:
            dk, dv = dk + later_k, dv + later_v
        return dq, dk, dv, None, None, None, None


def unit_attention(
    context: KVContext,
    layer_id: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: AttentionKernel,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of the context's current unit in layer ``layer_id``.

    q: (B, Hq, L, D) post-RoPE; k, v: (B, Hkv, L, D) post-RoPE, before GQA
    expansion. Returns (B, Hq, L, D).
    """
    if context.recomputing:
        prefix, block = context.recorded(layer_id)
    else:
        prefix, block = context.append(layer_id, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _UnitAttention.apply(q, k, v, block, prefix, kernel, scale)


class SequenceAttention(nn.Module):
    """Drop-in for torchtitan's ``ScaledDotProductAttentionWrapper``.

    Outside a unit (no context bound, no unit running or recomputed) it computes exactly
    what torchtitan's Llama 3 computes: causal SDPA over the whole sequence.
    Inside a unit it runs :func:`unit_attention`. The context and the kernel
    are set by :meth:`bind`, not at construction, because torchtitan deep-copies
    the model per pipeline stage and each stage has its own context.
    """

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.kv_context: KVContext | None = None
        self.kernel: AttentionKernel | None = None

    def bind(self, context: KVContext | None, kernel: AttentionKernel | None) -> None:
        self.kv_context, self.kernel = context, kernel

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        context = self.kv_context
        if context is None or (context.unit is None and not context.recomputing):
            return F.scaled_dot_product_attention(
                q, k, v, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa
            )
        if not is_causal:
            raise ValueError("SequenceAttention runs units of causal attention only")
        return unit_attention(context, self.layer_id, q, k, v, self.kernel, scale)


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
