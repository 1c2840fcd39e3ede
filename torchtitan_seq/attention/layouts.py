"""How unit attention lays out what it returns: outputs and gradients (B, H, L, D) as (B, L, H, D) in
memory, log-sum-exps as the kernels of the device lay theirs out, as torch's attention kernels return
them, so that none is copied on the way in or out; and the fake implementations of the custom ops,
which must have those strides.
"""

from __future__ import annotations

import torch
from torch import Tensor


def heads_inner(t: Tensor) -> Tensor:
    """(B, H, L, D) laid out as (B, L, H, D) in memory (a copy only if it is not): what torch's
    attention kernels return, out and gradients alike. torchtitan's ``out.transpose(1, 2).contiguous()``
    then takes the output without a copy (so the output projection saves the same storage as this op
    does), and the gradients of q, k, v reach the projections' (B, L, H, D) views without one."""
    b, h, n, d = t.shape
    if t.stride() == (n * h * d, d, h * d, 1):  # as the kernels return it: no op at all
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def new_out(q: Tensor, dv: int) -> Tensor:
    """An empty output (B, H, L, Dv) for queries q (B, H, L, D), laid out as :func:`heads_inner` lays
    it out (as the kernels lay theirs out)."""
    b, h, n, _ = q.shape
    return q.new_empty(b, n, h, dv).transpose(1, 2)


def new_lse(q: Tensor) -> Tensor:
    """An empty log-sum-exp (B, H, L) float32 for queries q (B, H, L, D), laid out as the kernels of
    q's device lay theirs out: torch's CPU flash kernel (B, L, H) in memory, every CUDA kernel
    (B, H, L); so the op returns the kernel's own without a copy."""
    b, h, n, _ = q.shape
    if q.device.type == "cpu":
        return q.new_empty(b, n, h, dtype=torch.float32).transpose(1, 2)
    return q.new_empty(b, h, n, dtype=torch.float32)


def lse_layout(lse: Tensor) -> Tensor:
    """``lse`` (B, H, L) laid out as :func:`new_lse` lays it out (a copy only if it is not)."""
    if lse.device.type == "cpu":
        b, h, n = lse.shape
        if lse.stride() == (n * h, 1, h):  # as the CPU kernel returns it: no op at all
            return lse
        return lse.transpose(1, 2).contiguous().transpose(1, 2)
    return lse.contiguous()


def fake_attention(q: Tensor, k: Tensor, v: Tensor, *_: object) -> tuple[Tensor, Tensor]:
    """out (B, Hq, L, Dv) laid out as :func:`heads_inner` lays it out, and lse (B, Hq, L) float32 as
    :func:`new_lse` lays it out."""
    return new_out(q, v.shape[-1]), new_lse(q)


def sink_output(dsinks: Tensor | None, q: Tensor) -> Tensor:
    """The sinks' gradient as a custom op returns it: an op returns no None, so an empty tensor
    stands for "no sinks"."""
    return q.new_empty(0) if dsinks is None else dsinks


def fake_gradients(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, *_: object
) -> tuple[Tensor, ...]:
    """dq, dk, dv shaped like q, k, v, laid out as :func:`heads_inner` lays them out, and the sinks'
    gradient as :func:`sink_output` returns it."""
    grads = (t.new_empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).transpose(1, 2) for t in (q, k, v))
    return (*grads, sink_output(None if sinks is None else torch.empty_like(sinks), q))
