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

from torchtitan_seq.attention.sdpa_ops import SdpaOps

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


def _float32(lse: Tensor) -> Tensor:
    """A kernel's log-sum-exp in float32, as the kernels return it (no op then)."""
    return lse if lse.dtype == torch.float32 else lse.float()


class AttentionKernel(Protocol):
    """Block attention with log-sum-exp in torch's SDPA layout: q (B, Hq, Lq, D); k, v
    (B, Hkv, Lk, D) with Hq a multiple of Hkv. ``forward`` returns out (B, Hq, Lq, D) and
    lse (B, Hq, Lq) in float32; ``backward`` returns dq, dk, dv shaped like q, k, v.

    ``bottom_right``: a causal call with Lq < Lk aligns its mask at the bottom right (query i
    attends keys up to i + Lk - Lq), so a unit reads its prefix and its own keys in one call
    where its slab lays them out in order. A kernel that aligns top-left (torch's CPU and cuDNN
    kernels) gets square causal calls only, and the prefix in an unmasked call of its own: two
    calls per unit, merged once."""

    bottom_right: bool

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class CpuSdpaKernel:
    """torch's flash-attention kernel for the CPU (handles GQA natively; causal masks top-left)."""

    bottom_right = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse = SdpaOps.cpu_flash(q, k, v, 0.0, causal, scale=scale)
        return out, _float32(lse)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        return SdpaOps.cpu_flash_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


# Grouped K/V heads: torch's CUDA flash and cuDNN ops take them as they are (Hq a multiple of Hkv,
# the gradients of K/V summed over each group inside the kernel): their SDPA dispatch has admitted
# grouped heads for flash since torch 2.5 and for cuDNN since 2.8 (``check_batch_size_and_num_heads_dense``
# with GQA on, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), and the ops' meta kernels shape
# dK/dV like K/V. So no adapter repeats heads or sums their gradients back.


class CudaSdpaKernel:
    """torch's own CUDA flash-attention kernel (fp16/bf16), used without flash-attn; grouped
    K/V heads native. A causal call with Lq < Lk aligns its mask at the bottom right, as
    FlashAttention 2, whose kernel it is, does: torch's SDPA keeps the flash kernel from
    non-square causal calls for that reason (``check_flash_causal_non_square_seqlens``,
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), and ``causal_lower_right``
    (torch/nn/attention/bias.py) calls this op with ``is_causal=True``."""

    bottom_right = True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = SdpaOps.flash(q, k, v, 0.0, causal, scale=scale)
        return out, _float32(lse)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        # None, as the forward returns them: defined sequence offsets select the varlen
        # kernel, and without dropout the RNG state is never read. The kernel reads lse by its data
        # pointer as (B, H, Lq) laid out densely, whatever its strides: a call over part of a unit's
        # queries (a document's) has a strided view of the unit's lse, which is copied (out and dout
        # the op makes dense itself).
        # Positional as the aten schema lists them, a few to a line (not one argument per line).
        # fmt: off
        return SdpaOps.flash_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, None, None,
            scale=scale,
        )
        # fmt: on


class CudnnSdpaKernel:
    """torch's cuDNN attention kernel (fp16/bf16), the one torch's SDPA picks on Hopper, where it
    runs forward + backward faster than the flash kernel at long sequences (see benchmarks/README.md);
    grouped K/V heads native. The aten op takes no mask alignment (top-left)."""

    bottom_right = False

    def __init__(self) -> None:
        self._rng: dict[torch.device, Tensor] = {}  # the unread RNG state, one per device, not one per call

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = SdpaOps.cudnn(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, _float32(lse.view(q.shape[:-1]))  # cuDNN's lse is (B, H, L, 1)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        # Without dropout the RNG state is not read; no sequence offsets: not the varlen kernel.
        rng = self._rng.get(q.device)
        if rng is None:
            rng = self._rng[q.device] = torch.zeros((), dtype=torch.int64, device=q.device)
        # out and dout as they come, both laid out (B, L, H, D) as the forward wrote out: cuDNN wants
        # their strides alike (torch copies dout to out's layout where they differ); no contiguous copy.
        # fmt: off
        return SdpaOps.cudnn_backward(
            dout, q, k, v, out, lse.unsqueeze(-1).contiguous(),
            rng, rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        # fmt: on


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
        return out.transpose(1, 2), _float32(lse)

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
    """The block kernel for ``device``.

    Args:
        device: the device the kernel runs on.
        backend: ``[sequence_pipeline] attention_backend``: ``"auto"`` (on CUDA: torch's cuDNN kernel on
            Hopper and newer, else flash-attn when importable, else torch's flash kernel; on the CPU
            torch's), ``"flash"`` (flash-attn) or ``"sdpa"`` (torch's kernels).

    Returns:
        An :class:`AttentionKernel`.

    Raises:
        ValueError: for an unknown backend, or ``"flash"`` without CUDA or without flash-attn installed.
    """
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
