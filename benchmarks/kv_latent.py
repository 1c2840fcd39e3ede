"""MLA's latent in the KV context: what ``kv_context = "latent"`` saves and what it costs, against ``"full"``.

    python benchmarks/kv_latent.py [--seq-len 1024] [--k 4] [--repeats 3]

DeepSeek-V3's debug flavor (torchtitan 0.2.2's ``debugmodel``: 6 layers, 16 heads, kv_lora_rank 512,
qk_rope_head_dim 64, float32) as one stage on the CPU, one microbatch of one sequence cut into k units
(the compute partition), each run forward in order and backward last unit first, in each mode:

- the peak bytes its KV context holds (:class:`~torchtitan_seq.instrumentation.kv_memory.KVMemory`, what
  the metrics' ``peak_kv_bytes`` measures);
- the FLOPs of the step (``torch.utils.flop_counter``: matrix products and attention kernels) and the
  expansion's share predicted by arithmetic: per layer and unit j at offset s_j, wkv_b over the prefix in
  forward, again in backward, and its input and weight gradients, 4 x 2 s_j r H (nope + v);
- the host's share: aten ops dispatched per step (each op is host work), and the step's wall time (median
  of ``--repeats``; on the CPU it holds the compute too).

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from torchtitan_seq.attention import bind_kv_context
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.plan.flops import latent_flops
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.titan import cpu_compat
from torchtitan_seq.titan.flavors import model_shape


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _model(seq_len: int) -> tuple[torch.nn.Module, object]:
    """DeepSeek-V3's debug flavor with chunk-aware attention, float32, its embeddings and output included."""
    import dataclasses

    from torchtitan.models.deepseek_v3 import get_train_spec

    from torchtitan_seq.titan.v022.models.sequence_model import sequence_model_class

    spec = get_train_spec()
    args = dataclasses.replace(spec.model_args["debugmodel"], max_seq_len=seq_len)
    args.moe_impl = "standard"  # as its update_from_config sets it
    torch.manual_seed(0)
    model = sequence_model_class(spec.model_cls)(args)
    with torch.no_grad():
        model.init_weights()
    return model, args


def _step(model, context: KVContext, tokens: torch.Tensor, lengths: list[int]) -> None:
    """One microbatch: its units forward in order, then backward last unit first."""
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    outs = []
    for j, (offset, length) in enumerate(zip(offsets, lengths)):
        with context.running(Unit(0, j, offset, length, len(lengths))):
            outs.append(model(tokens[:, offset : offset + length]).float().square().mean())
    for j in reversed(range(len(lengths))):
        with context.backward(Unit(0, j, offsets[j], lengths[j], len(lengths))):
            outs[j].backward()
    model.zero_grad(set_to_none=True)


def measure(mode: str, seq_len: int, k: int, repeats: int) -> dict:
    """Peak K/V bytes, FLOPs, aten ops and wall time of one microbatch under ``mode``."""
    model, args = _model(seq_len)
    lengths = JobShape.of_model(model_shape(args), seq_len, k, "compute").lengths
    context = KVContext(lengths, mode=mode)
    bind_kv_context(model, context, select_kernel(torch.device("cpu")))
    tokens = torch.randint(0, args.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    memory = KVMemory([context])
    with memory.track():
        _step(model, context, tokens, lengths)
    flops = FlopCounterMode(display=False)
    with flops:
        _step(model, context, tokens, lengths)
    ops = _OpCount()
    with ops:
        _step(model, context, tokens, lengths)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(model, context, tokens, lengths)
        times.append(time.perf_counter() - start)
    expansion = latent_flops(model_shape(args).mla, args.n_heads, lengths, 0.0)  # the planner's cost of it
    return {
        "peak_kv_bytes": memory.peak,
        "flops": flops.get_total_flops(),
        "expansion_flops": expansion * args.n_layers if mode == "latent" else 0,
        "ops": sum(ops.ops.values()),
        "seconds": statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cpu_compat.apply()
    torch.set_num_threads(1)
    full, latent = (measure(mode, args.seq_len, args.k, args.repeats) for mode in ("full", "latent"))
    print(f"DeepSeek-V3 debugmodel, one stage of 6 layers, S = {args.seq_len}, k = {args.k} (compute), float32, CPU")
    print()
    print("| figure | full | latent | latent / full |")
    print("|---|---|---|---|")
    rows = [
        ("peak K/V bytes (`peak_kv_bytes`)", "peak_kv_bytes", "{:,}"),
        ("FLOPs a step", "flops", "{:.4g}"),
        ("aten ops a step (host work)", "ops", "{:,}"),
        ("wall time a step, s", "seconds", "{:.3f}"),
    ]
    for name, key, fmt in rows:
        print(f"| {name} | {fmt.format(full[key])} | {fmt.format(latent[key])} | {latent[key] / full[key]:.3f} |")
    share = latent["expansion_flops"] / full["flops"]
    print(f"\nthe prefix's expansion by arithmetic: {latent['expansion_flops']:.4g} FLOPs, {share:.3f} of full's")


if __name__ == "__main__":
    main()
