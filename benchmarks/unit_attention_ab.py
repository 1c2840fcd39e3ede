"""Unit attention alone, forward + backward of every unit of one microbatch, as a stage runs them.

    python benchmarks/unit_attention_ab.py SEQ_LEN K        # prints the median ms of 5 runs

One ``SequenceAttention`` layer bound to a fresh ``KVContext`` on the CPU kernel, the debug
model's attention shape (batch 1, 16 heads of 16, K/V as the model hands them: (B, L, H, D) in
memory), units forward in order and backward last unit first, one thread. Run it with
``PYTHONPATH`` at two checkouts, alternating, to compare their unit attention with nothing else
in the way (the step-time benchmark's noise on this machine is larger than the difference).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.attention.kernels import CpuSdpaKernel
from torchtitan_seq.runtime.kv_context import KVContext, Unit


def _context(lengths: list[int]) -> KVContext:
    try:
        return KVContext(lengths)  # the slab's context is sized by the stage's lengths
    except TypeError:
        return KVContext()  # before the slab


def one_microbatch(qkv: list[torch.Tensor], dout: torch.Tensor, lengths: list[int]) -> None:
    """qkv: three (B, S, H, D) tensors; dout: (B, H, S, D)."""
    q, k, v = (t.clone().transpose(1, 2).requires_grad_() for t in qkv)
    context, attention = _context(lengths), SequenceAttention(0)
    attention.bind(context, CpuSdpaKernel())
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    units = [Unit(0, j, offsets[j], n, len(lengths)) for j, n in enumerate(lengths)]
    outs = []
    for u in units:
        part = slice(u.offset, u.offset + u.length)
        with context.running(u):
            outs.append(attention(q[:, :, part], k[:, :, part], v[:, :, part]))
    for u in reversed(units):
        with context.backward(u):
            outs[u.index].backward(dout[:, :, u.offset : u.offset + u.length])


def main() -> None:
    seq_len, k = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    qkv = [torch.randn(1, seq_len, 16, 16) for _ in range(3)]
    dout = torch.randn(1, 16, seq_len, 16)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        one_microbatch(qkv, dout, [seq_len // k] * k)
        times.append(time.perf_counter() - start)
    print(f"{statistics.median(times[2:]) * 1e3:.1f}")


if __name__ == "__main__":
    main()
