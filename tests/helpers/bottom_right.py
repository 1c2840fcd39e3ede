"""A CPU attention kernel that aligns causal masks bottom-right, as flash-attn and torch's CUDA flash
kernel do on a GPU.

With it the unit attention takes the path those take (:mod:`torchtitan_seq.attention`): a unit reads
its prefix and its own keys in one causal call where its slab is ascending (two calls on a descending
one, and for the last unit, whose keys the slab does not hold), on a machine without a GPU. It is the
:class:`~torchtitan_seq.attention.kernels.AttentionKernel` protocol in plain float32 matrix products, exact
to round-off; every exactness variant runs its compared step with it as well as with torch's CPU kernel
(``Variant.kernels``, tests/helpers/harness.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BottomRightCpuKernel"]


def _expand(t: Tensor, n_rep: int) -> Tensor:
    """K or V (B, Hkv, L, D) repeated to (B, Hkv * n_rep, L, D): GQA by copies (as repeat_interleave
    on dim 1, which the host-read instrument counts: with a tensor of repeats it syncs)."""
    b, h, length, d = t.shape
    return t.unsqueeze(2).expand(b, h, n_rep, length, d).reshape(b, h * n_rep, length, d)


def _reduce(t: Tensor, n_rep: int) -> Tensor:
    """The gradient of :func:`_expand`'s output summed back to (B, Hkv, L, D)."""
    return t.unflatten(1, (-1, n_rep)).sum(2)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, band) -> Tensor:
    """(B, Hq, Lq, Lk) scaled scores; causal: query i sees keys up to i + Lk - Lq (bottom-right); a band
    (shift, window): query i sees key j only where i + shift - j < window."""
    scores = q @ k.transpose(-2, -1) * scale
    lq, lk = q.shape[2], k.shape[2]
    shift = lk - lq if band is None else band[0]
    distance = torch.arange(lq).unsqueeze(1) + shift - torch.arange(lk).unsqueeze(0)
    hidden = torch.zeros(lq, lk, dtype=torch.bool)
    if causal:
        hidden |= distance < 0
    if band is not None:
        hidden |= distance >= band[1]
    return scores.masked_fill(hidden, float("-inf"))


class BottomRightCpuKernel:
    """Block attention with log-sum-exp: q (B, Hq, Lq, D); k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), Hq a
    multiple of Hkv; a causal call aligns its mask bottom-right (Lq <= Lk); a band windows it."""

    bottom_right = True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, band=None) -> tuple[Tensor, Tensor]:
        """out (B, Hq, Lq, Dv) and lse (B, Hq, Lq), float32."""
        n_rep = q.shape[1] // k.shape[1]
        scores = _scores(q, _expand(k, n_rep), causal, scale, band)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.exp(scores - lse.unsqueeze(-1)) @ _expand(v, n_rep)
        return out, lse.float()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
        band=None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """dq, dk, dv shaped like q, k, v: softmax's gradient with the forward's lse, as flash kernels take it."""
        n_rep = q.shape[1] // k.shape[1]
        ke, ve = _expand(k, n_rep), _expand(v, n_rep)
        probs = torch.exp(_scores(q, ke, causal, scale, band) - lse.unsqueeze(-1))
        dprobs = dout @ ve.transpose(-2, -1)
        dscores = probs * (dprobs - (dout * out).sum(-1, keepdim=True))
        dq = dscores @ ke * scale
        dk = dscores.transpose(-2, -1) @ q * scale
        dv = probs.transpose(-2, -1) @ dout
        return dq, _reduce(dk, n_rep), _reduce(dv, n_rep)
