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

import functools
import importlib
from typing import Literal, NamedTuple, Protocol, get_args

import torch
from torch import Tensor

from torchtitan_seq.attention.sdpa_ops import SdpaOps

__all__ = [
    "AttentionBackend",
    "Band",
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


class Band(NamedTuple):
    """A sliding window over a call's keys: query i (the call's first query lying ``shift`` positions
    after its first key) reads key j only where i + shift - j < ``window``, and, in a causal call,
    j <= i + shift (bottom-right alignment: shift = Lk - Lq)."""

    shift: int
    window: int


@functools.lru_cache(maxsize=256)
def band_mask(band: Band, queries: int, keys: int, causal: bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The additive mask (queries, keys) of ``dtype`` on ``device`` of a call windowed by ``band``: 0
    where a query reads a key, -inf elsewhere; made once per call shape (the same units every step)."""
    distance = torch.arange(queries, device=device).unsqueeze(1) + band.shift - torch.arange(keys, device=device)
    reads = distance < band.window
    if causal:
        reads &= distance >= 0
    return torch.zeros(queries, keys, dtype=dtype, device=device).masked_fill_(~reads, float("-inf"))


def _padded(v: Tensor, width: int) -> Tensor:
    """``v`` (..., Dv) padded with zeros to ``width`` (the query/key head width) for a kernel that takes
    one head width: zero value columns add nothing to the others' softmax-weighted sums (nor to the
    backward's dout . out), and are cut off again. Itself where it is that wide."""
    return v if v.shape[-1] == width else torch.nn.functional.pad(v, (0, width - v.shape[-1]))


class AttentionKernel(Protocol):
    """Block attention with log-sum-exp in torch's SDPA layout: q (B, Hq, Lq, D); k, v
    (B, Hkv, Lk, D) with Hq a multiple of Hkv. ``forward`` returns out (B, Hq, Lq, D) and
    lse (B, Hq, Lq) in float32; ``backward`` returns dq, dk, dv shaped like q, k, v. Values may be
    narrower than queries and keys (MLA's: v (B, Hkv, Lk, Dv), out (B, Hq, Lq, Dv)). A call given a
    :class:`Band` reads only the keys within its window.

    ``bottom_right``: a causal call with Lq < Lk aligns its mask at the bottom right (query i
    attends keys up to i + Lk - Lq), so a unit reads its prefix and its own keys in one call
    where its slab lays them out in order. A kernel that aligns top-left (torch's CPU and cuDNN
    kernels) gets square causal calls only, and the prefix in an unmasked call of its own: two
    calls per unit, merged once."""

    bottom_right: bool

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, band: Band | None = None
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        band: Band | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]: ...  # fmt: skip


class CpuSdpaKernel:
    """torch's flash-attention kernel for the CPU (handles GQA natively; causal masks top-left; one head
    width, so narrower values are padded; a window as an additive mask)."""

    bottom_right = False

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, band: Band | None = None
    ) -> tuple[Tensor, Tensor]:
        width = v.shape[-1]
        mask = None if band is None else band_mask(band, q.shape[2], k.shape[2], causal, q.dtype, q.device)
        causal = causal and mask is None
        out, lse = SdpaOps.cpu_flash(q, k, _padded(v, q.shape[-1]), 0.0, causal, attn_mask=mask, scale=scale)
        return out[..., :width], _float32(lse)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        band: Band | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        width, full = v.shape[-1], q.shape[-1]
        mask = None if band is None else band_mask(band, q.shape[2], k.shape[2], causal, q.dtype, q.device)
        causal = causal and mask is None
        dout, v, out = (_padded(t, full) for t in (dout, v, out))
        dq, dk, dv = SdpaOps.cpu_flash_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
        return dq, dk, dv[..., :width]


# Grouped K/V heads: torch's CUDA flash and cuDNN ops take them as they are (Hq a multiple of Hkv,
# the gradients of K/V summed over each group inside the kernel): their SDPA dispatch has admitted
# grouped heads for flash since torch 2.5 and for cuDNN since 2.8 (``check_batch_size_and_num_heads_dense``
# with GQA on, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), and the ops' meta kernels shape
# dK/dV like K/V. So no adapter repeats heads or sums their gradients back.


class CudnnSdpaKernel:
    """torch's cuDNN attention kernel (fp16/bf16), the one torch's SDPA picks on Hopper, where it
    runs forward + backward faster than the flash kernel at long sequences (see benchmarks/README.md);
    grouped K/V heads native; a window as an additive bias. The aten op takes no mask alignment
    (top-left)."""

    bottom_right = False

    def __init__(self) -> None:
        self._rng: dict[torch.device, Tensor] = {}  # the unread RNG state, one per device, not one per call

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, band: Band | None = None
    ) -> tuple[Tensor, Tensor]:
        width, bias = v.shape[-1], _bias(band, q, k, causal)
        causal = causal and bias is None
        out, lse, *_ = SdpaOps.cudnn(q, k, _padded(v, q.shape[-1]), bias, True, 0.0, causal, False, scale=scale)
        return out[..., :width], _float32(lse.view(q.shape[:-1]))  # cuDNN's lse is (B, H, L, 1)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        band: Band | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        # Without dropout the RNG state is not read; no sequence offsets: not the varlen kernel.
        rng = self._rng.get(q.device)
        if rng is None:
            rng = self._rng[q.device] = torch.zeros((), dtype=torch.int64, device=q.device)
        width, full, bias = v.shape[-1], q.shape[-1], _bias(band, q, k, causal)
        causal = causal and bias is None
        dout, v, out = (_padded(t, full) for t in (dout, v, out))
        # out and dout as they come, both laid out (B, L, H, D) as the forward wrote out: cuDNN wants
        # their strides alike (torch copies dout to out's layout where they differ); no contiguous copy.
        # fmt: off
        dq, dk, dv = SdpaOps.cudnn_backward(
            dout, q, k, v, out, lse.unsqueeze(-1).contiguous(),
            rng, rng, bias, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        # fmt: on
        return dq, dk, dv[..., :width]


def _bias(band: Band | None, q: Tensor, k: Tensor, causal: bool) -> Tensor | None:
    """The additive (B, Hq, Lq, Lk) bias a cuDNN call is windowed by (an expanded view of
    :func:`band_mask`); None without a window."""
    if band is None:
        return None
    mask = band_mask(band, q.shape[2], k.shape[2], causal, q.dtype, q.device)
    return mask.expand(q.shape[0], q.shape[1], *mask.shape)


class CudaSdpaKernel:
    """torch's own CUDA flash-attention kernel (fp16/bf16), used without flash-attn; grouped
    K/V heads native. A causal call with Lq < Lk aligns its mask at the bottom right, as
    FlashAttention 2, whose kernel it is, does: torch's SDPA keeps the flash kernel from
    non-square causal calls for that reason (``check_flash_causal_non_square_seqlens``,
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), and ``causal_lower_right``
    (torch/nn/attention/bias.py) calls this op with ``is_causal=True``. The kernel takes no mask: a
    windowed call runs on cuDNN's (:class:`CudnnSdpaKernel`)."""

    bottom_right = True

    def __init__(self) -> None:
        self._banded = CudnnSdpaKernel()

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, band: Band | None = None
    ) -> tuple[Tensor, Tensor]:
        if band is not None:
            return self._banded.forward(q, k, v, causal, scale, band)
        width = v.shape[-1]
        out, lse, *_ = SdpaOps.flash(q, k, _padded(v, q.shape[-1]), 0.0, causal, scale=scale)
        return out[..., :width], _float32(lse)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        band: Band | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        if band is not None:
            return self._banded.backward(dout, q, k, v, out, lse, causal, scale, band)
        width, full = v.shape[-1], q.shape[-1]
        dout, v, out = (_padded(t, full) for t in (dout, v, out))
        # None, as the forward returns them: defined sequence offsets select the varlen
        # kernel, and without dropout the RNG state is never read. The kernel reads lse by its data
        # pointer as (B, H, Lq) laid out densely, whatever its strides: a call over part of a unit's
        # queries (a document's) has a strided view of the unit's lse, which is copied (out and dout
        # the op makes dense itself).
        # Positional as the aten schema lists them, a few to a line (not one argument per line).
        # fmt: off
        dq, dk, dv = SdpaOps.flash_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, None, None,
            scale=scale,
        )
        # fmt: on
        return dq, dk, dv[..., :width]


_FLASH_ATTN_PLAIN = dict(dropout_p=0.0, softcap=0.0, alibi_slopes=None)
"""flash-attn's options for plain attention: no dropout, softcap or ALiBi."""


def _flash_window(band: Band | None, q: Tensor, k: Tensor, causal: bool) -> dict[str, int]:
    """flash-attn's window of a call: it reads keys [i + Lk - Lq - left, i + Lk - Lq + right] for query i
    (-1: no bound), so a band of shift s and window w is left = w - 1 - (s - (Lk - Lq))."""
    if band is None:
        return dict(window_size_left=-1, window_size_right=-1)
    left = band.window - 1 - (band.shift - (k.shape[2] - q.shape[2]))
    return dict(window_size_left=left, window_size_right=0 if causal else -1)


class FlashAttnKernel:
    """flash-attn 2 (CUDA). Its layout is (B, L, H, D); GQA is native; causal masks align at
    the bottom right when Lq < Lk (flash-attn >= 2.1); windows native; one head width, so narrower
    values are padded."""

    bottom_right = True

    def __init__(self) -> None:
        self._fa = importlib.import_module("flash_attn.flash_attn_interface")

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, band: Band | None = None
    ) -> tuple[Tensor, Tensor]:
        width = v.shape[-1]
        out, lse, *_ = self._fa._flash_attn_forward(
            q.transpose(1, 2),
            k.transpose(1, 2),
            _padded(v, q.shape[-1]).transpose(1, 2),
            softmax_scale=scale,
            causal=causal,
            return_softmax=False,
            **_flash_window(band, q, k, causal),
            **_FLASH_ATTN_PLAIN,
        )
        return out.transpose(1, 2)[..., :width], _float32(lse)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        band: Band | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        width, full = v.shape[-1], q.shape[-1]
        dout, v, out = (_padded(x, full) for x in (dout, v, out))
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
            **_flash_window(band, q, k, causal),
            **_FLASH_ATTN_PLAIN,
        )
        return t(dq), t(dk), t(dv)[..., :width]


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
