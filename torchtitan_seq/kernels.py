"""Block attention kernels: what unit attention (:mod:`torchtitan_seq.attention`) calls.

A kernel computes softmax attention of one block of queries against one block of keys, with
its log-sum-exp, forward and backward, in torch's SDPA layout (:class:`AttentionKernel`). The
adapters here wrap torch's CPU flash kernel (:class:`CpuSdpaKernel`), torch's CUDA flash and
cuDNN kernels (:class:`CudaSdpaKernel`, :class:`CudnnSdpaKernel`) and flash-attn 2
(:class:`FlashAttnKernel`, imported when constructed: an optional extra); :func:`select_kernel`
picks one for a device and the ``attention_backend`` setting (:data:`AttentionBackend`), with a
clear error where flash-attn is asked for and absent. Importing this module imports no kernel
library.
"""

from __future__ import annotations

import importlib
from typing import Literal, Protocol, get_args

import torch
from torch import Tensor

__all__ = [
    "AttentionBackend",
    "AttentionKernel",
    "CpuSdpaKernel",
    "CudaSdpaKernel",
    "CudnnSdpaKernel",
    "FlashAttnKernel",
    "select_kernel",
]

# The ``[sequence_pipeline] attention_backend`` setting: see :func:`select_kernel`.
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
    """Grouped K or V heads (B, Hkv, L, D) repeated to (B, Hkv * n_rep, L, D), for kernels without GQA."""
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def _reduce(t: Tensor, n_rep: int) -> Tensor:
    """The gradient of :func:`_expand`'s output (B, Hkv * n_rep, L, D) summed back to (B, Hkv, L, D)."""
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
        # Positional as the aten schema lists them, a few to a line (not one argument per line).
        # fmt: off
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, _expand(k, n_rep), _expand(v, n_rep), out, lse,
            None, None, q.shape[2], k.shape[2], 0.0, causal, None, None, scale=scale,
        )
        # fmt: on
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
        # fmt: off
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, _expand(k, n_rep), _expand(v, n_rep), out.contiguous(), lse.unsqueeze(-1).contiguous(),
            rng, rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        # fmt: on
        return dq, _reduce(dk, n_rep), _reduce(dv, n_rep)


_FLASH_ATTN_PLAIN = dict(dropout_p=0.0, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None)
"""flash-attn's options for plain attention: no dropout, no sliding window, softcap or ALiBi."""


class FlashAttnKernel:
    """flash-attn 2 (CUDA). Its layout is (B, L, H, D); GQA is native; causal masks align at
    the bottom right when Lq < Lk (flash-attn >= 2.1)."""

    bottom_right = True

    def __init__(self) -> None:
        self._fa = importlib.import_module("flash_attn.flash_attn_interface")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = self._fa._flash_attn_forward(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            softmax_scale=scale,
            causal=causal,
            return_softmax=False,
            **_FLASH_ATTN_PLAIN,
        )
        return out.transpose(1, 2), lse.float()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
        self._fa._flash_attn_backward(
            t(dout).contiguous(),
            t(q),
            t(k),
            t(v),
            t(out).contiguous(),
            lse.contiguous(),
            dq,
            dk,
            dv,
            softmax_scale=scale,
            causal=causal,
            deterministic=False,
            rng_state=None,
            **_FLASH_ATTN_PLAIN,
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
