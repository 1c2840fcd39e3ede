"""Host cost of the unit path per unit and layer: leaf aten ops and host microseconds, two checkouts alternating.

    python benchmarks/unit_host.py --trees OLD NEW [--rounds 5] [--repeats 25] [--out DIR]
    python benchmarks/unit_host.py --count [--device cuda] [--out DIR]   # this checkout's figures, as JSON

One InterleavedSeq1F1B step on one CPU rank through the public API (p = 1: both stages of a 2-stage
pipeline on the rank), a tiny Llama 3 (dim 64, 4 layers, 4 heads, 2 KV heads, 128 tokens, 2
microbatches of one sequence), one thread, where compute is negligible and what is measured is what
the host does for each (unit, layer). Per unit and layer: the step at k = 8 minus the step at k = 1,
over the unit-layers added (2 microbatches x 7 units x 4 layers); against a plain layer of
torchtitan's Llama 3 on the whole batch (4 layers minus 2, halved), forward and backward.

* leaf aten ops: the profiler's aten ops with no aten op beneath them, views left out (about one
  kernel launch each on a GPU). Counted with the CPU kernel, and with the CUDA adapters' op sequences
  (torch's cuDNN and flash kernels) against fakes of their aten ops on the CPU (each fake counted as
  the one op it stands for);
* host µs: the minimum over ``--repeats`` steps of the thread's CPU time (a GPU's host runs no
  faster than its best; CPU time, not wall time, so that a shared machine's load does not count).
  On the CPU a step's time includes its compute (the plain layer's is mostly compute), so
* the unit path's own host µs are measured apart, per unit-layer added: attention layers of the
  model's shape bound to a KV context, chained (a layer's output the next one's queries), the K units
  of one sequence forward in order and backward last unit first, as a stage runs them, minus torch's
  SDPA (what a plain layer calls) forward and backward on the whole sequence (the same pairs of
  queries and keys, so the same compute); 4 layers minus 2 (what a unit pays once, its autograd
  call, cancels), halved, over the K - 1 units added; every run alternating, least of ``--repeats``
  each. On the CPU the kernels' compute is host time, so the same is measured as a GPU's host meets
  it: the CUDA adapters' op sequences against fakes of their aten ops that compute nothing (zeros of
  the outputs' shapes, about what a launch costs the host), K units against one unit (the whole
  sequence through the same op);
* a descending slab's kernels: one attention layer run as Seq1F1B's first stage of 2 runs 4 microbatches,
  the KV context told the stage's passes (microbatches share arenas from opposite ends, so every other
  one's slab runs last position first) minus not told (ascending slabs of their own), over the
  descending unit-layers; leaf ops with views beneath them counted too (``through_views``), as torch's
  CPU indexed copies and adds make views inside.

On a CUDA device (``--device cuda``, what ``benchmarks/gpu_check.sh`` runs after the GPU check) the
model is in bf16 with the device's kernel (:func:`~torchtitan_seq.attention.kernels.select_kernel`: cuDNN on an
H200), and the figures are the device's: kernel launches per unit-layer (the profiler's CUDA kernel,
memcpy and memset events), and host µs (the step's issue time, no sync inside it) against device µs
(CUDA events around the step): a unit path whose host time is under its device time keeps the GPU
busy; ``--out`` gets ``unit_host_<device>.json``.

With ``--trees`` each checkout runs in a fresh interpreter of its own, in turn, the order reversed
every round, and the 1-minute load average is read before each; ``--out`` gets ``unit_host.json``
(every round) and ``unit_host.md`` (the minima over the rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

CPU = torch.device("cpu")
MODEL = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=16, rope_theta=10000, vocab_size=128)
SEQ_LEN, MICROBATCHES, K = 128, 2, 8
UNIT_LAYERS = MICROBATCHES * (K - 1) * MODEL["n_layers"]  # unit-layers added from k = 1 to k = K
ADAPTERS = ("CudnnSdpaKernel", "CudaSdpaKernel")  # torch's CUDA kernels' adapters (torchtitan_seq.attention.kernels)
# The CUDA-only aten ops the adapters call, each faked on the CPU and counted as one launch.
_FAKED = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
)


def _is_view(name: str) -> bool:
    """Whether aten op ``name`` (``aten::x``) runs no kernel: every overload returns a view of an input
    (``to`` that changes nothing returns its input) or no tensor (``result_type``), or it is
    ``_unsafe_view``."""
    if name == "aten::_unsafe_view":  # a view whose schema does not say so
        return True
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return False
    for overload in packet.overloads():
        returns = getattr(packet, overload)._schema.returns
        tensors = [r for r in returns if isinstance(r.type, torch.TensorType)]
        if any(r.alias_info is None or r.alias_info.is_write for r in tensors):
            return False
    return True


def leaf_ops(fn: Callable[[], object], through_views: bool = False) -> int:
    """The aten ops ``fn`` runs with no aten op beneath them, views left out; a fake CUDA op counts once.
    ``through_views``: with no aten op but views beneath them (torch's CPU ``mm``, ``index_copy_`` and
    ``index_add_`` make views inside: one kernel each on a GPU, which the plain count misses)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    views: dict[str, bool] = {}

    def count(event) -> int:
        if event.name.startswith("fake::"):
            return 1
        below = sum(count(c) for c in event.cpu_children)
        aten = [c for c in event.cpu_children if c.name.startswith(("aten::", "fake::"))]
        if below or (aten and not through_views) or not event.name.startswith("aten::"):
            return below
        if event.name not in views:
            views[event.name] = _is_view(event.name)
        return 0 if views[event.name] else 1

    return sum(count(e) for e in prof.events() if e.cpu_parent is None)


def _sdpa_home():
    """The module holding ``SdpaOps``: torchtitan_seq.attention.sdpa_ops, or torch_internals in older checkouts."""
    try:
        from torchtitan_seq.attention import sdpa_ops
    except ImportError:
        from torchtitan_seq.runtime import torch_internals as sdpa_ops
    return sdpa_ops


def _fake_op(name: str, compute: bool = True) -> Callable:
    """``torch.ops.aten.<name>`` computed by the CPU kernel (grouped heads native, as in the CUDA ops),
    in a profiler range ``fake::<name>`` that :func:`leaf_ops` counts as one op; without ``compute``
    its outputs are zeros of their shapes and layouts, nothing else (what the host pays for a launch,
    about: an allocation and fill per output). Positional arguments as the aten schemas list them: q, k, v
    first; dout, q, k, v, out, lse first backward."""
    from torchtitan_seq.attention.kernels import CpuSdpaKernel

    SdpaOps = _sdpa_home().SdpaOps
    cpu, cudnn = CpuSdpaKernel(), "cudnn" in name
    causal_at = {"flash": 4, "cudnn": 6, "flash_backward": 11, "cudnn_backward": 14}

    def bottom_right(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The mask of a causal call with fewer queries than keys, aligned bottom-right as torch's CUDA
        flash kernel aligns it (the CPU kernel's own causal mask is top-left)."""
        lq, lk = q.shape[2], k.shape[2]
        return torch.full((lq, lk), float("-inf"), dtype=q.dtype).triu_(lk - lq + 1)

    def fake(*args, **kwargs):
        kind = name.removeprefix("_scaled_dot_product_").removesuffix("_attention").replace("_attention", "")
        causal, scale = args[causal_at[kind]], kwargs["scale"]
        with torch.profiler.record_function(f"fake::{name}"):
            forward = not name.endswith("_backward")
            q, k = args[:2] if forward else args[1:3]
            if causal and q.shape[2] != k.shape[2]:
                mask = dict(attn_mask=bottom_right(q, k), scale=scale)
                if forward:
                    return SdpaOps.cpu_flash(*args[:3], 0.0, False, **mask)
                return SdpaOps.cpu_flash_backward(*args[:6], 0.0, False, **mask)
            if forward:
                out, lse = cpu.forward(*args[:3], causal, scale)
                return out, lse.unsqueeze(-1) if cudnn else lse
            dout, q, k, v, out, lse = args[:6]
            return cpu.backward(dout, q, k, v, out, lse.squeeze(-1) if cudnn else lse, causal, scale)

    def launch(*args, **kwargs):  # out laid out as q (the kernels' (B, L, H, D)), lse (B, H, L[, 1])
        if not name.endswith("_backward"):
            q = args[0]
            return torch.zeros_like(q), q.new_zeros((*q.shape[:-1], 1) if cudnn else q.shape[:-1])
        return tuple(torch.zeros_like(t) for t in args[1:4])

    return fake if compute else launch


@contextlib.contextmanager
def _fake_cuda_ops(compute: bool = True) -> Iterator[None]:
    """The CUDA-only ops faked where the adapters find them: ``SdpaOps``' attributes, or in
    ``torch.ops.aten`` for older checkouts, whose ``SdpaOps`` looked them up there at each call."""
    home = _sdpa_home()
    names = getattr(home, "SDPA_OPS", None)
    owner, attributes = home.SdpaOps, {a: n for a, n in (names or {}).items() if n in _FAKED}
    if names is None:
        owner, attributes = torch.ops.aten, {n: n for n in _FAKED}
    saved = {attr: getattr(owner, attr) for attr in attributes}
    try:
        for attr, name in attributes.items():
            setattr(owner, attr, _fake_op(name, compute))
        yield
    finally:
        for attr, op in saved.items():
            setattr(owner, attr, op)


def _kernel(name: str):
    from torchtitan_seq.attention import kernels

    return getattr(kernels, name)()


def _to_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model on ``device``, in bf16 on a GPU (whose kernels take no float32); children only, the
    model's own buffer being the complex RoPE table."""
    model.to(device)
    if device.type == "cuda":
        for child in model.children():
            child.to(torch.bfloat16)
    return model


def pipeline_step(k: int, kernel: str | None = None, device: torch.device = CPU) -> Callable[[], None]:
    """One InterleavedSeq1F1B step at ``k`` units per microbatch with ``kernel`` (None: the device's),
    as a closure."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    from torchtitan.models.llama3 import TransformerModelArgs

    from torchtitan_seq.runtime.loss import TokenNormalizedLoss
    from torchtitan_seq.runtime.partition import partition_sequence
    from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
    from torchtitan_seq.schedules.stage import SequencePipelineStage
    from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer
    from torchtitan_seq.titan.v022.pipeline import split_model

    torch.manual_seed(0)
    model = _to_device(SeqTransformer(TransformerModelArgs(**MODEL, max_seq_len=SEQ_LEN)), device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("pp",))
    chunks = split_model(model, mesh, "InterleavedSeq1F1B", device, generate_llm_fqn_per_model_part(2, 4, 1, 1))
    lengths, group = partition_sequence(SEQ_LEN, k, "even"), mesh.get_group()
    chosen = _kernel(kernel) if kernel else None
    stages = [
        SequencePipelineStage(c, i, 2, device, lengths=lengths, chain_length=n, group=group, kernel=chosen)
        for i, n, c in chunks
    ]
    loss_fn = TokenNormalizedLoss(cross_entropy_loss)
    schedule = SEQUENCE_SCHEDULES["InterleavedSeq1F1B"](stages, MICROBATCHES, loss_fn)
    tokens, labels = (t.to(device) for t in _batch())
    tokens_in_step = torch.tensor(float(labels.numel()), device=device)  # as the trainer's global_valid_tokens

    def step() -> None:
        with loss_fn.normalized_by(tokens_in_step):
            schedule.step(tokens, target=labels, losses=[])

    return step


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(MODEL["vocab_size"], (MICROBATCHES, SEQ_LEN), generator=g) for _ in range(2))


def plain_step(n_layers: int, device: torch.device = CPU) -> Callable[[], None]:
    """Forward and backward of torchtitan's Llama 3 with ``n_layers`` layers on the whole batch."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(**{**MODEL, "n_layers": n_layers}, max_seq_len=SEQ_LEN))
    with torch.no_grad():
        model.init_weights()
    model = _to_device(model, device)
    tokens, labels = (t.to(device) for t in _batch())
    return lambda: cross_entropy_loss(model(tokens), labels).backward()


def attention_steps(
    device: torch.device = CPU, k: int = K, kernel: str | None = None, layers: int = 1
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The unit path and torch's SDPA on the same sequence, as closures: ``layers`` attention layers of
    the model's shape (1 sequence of SEQ_LEN tokens; q (1, Hq, L, D) and each layer's k, v
    (1, Hkv, L, D) laid out as the model's projections hand them, (1, L, H, D) in memory; a layer's
    output is the next one's q), ``k`` units forward in order and backward last unit first through a
    KV context with ``kernel`` (None: the device's); and SDPA (causal, grouped heads: what a plain
    layer calls) forward and backward on the whole sequence, the same (query, key) pairs in one call
    a layer. A unit's tensors are its own, as a unit's projections make them; gradients are taken
    (one autograd call per unit, as a stage makes), not accumulated."""
    from torchtitan_seq.attention import SequenceAttention
    from torchtitan_seq.attention.kernels import select_kernel
    from torchtitan_seq.runtime.kv_context import KVContext, Unit
    from torchtitan_seq.runtime.partition import partition_sequence

    heads, kv_heads = MODEL["n_heads"], MODEL["n_kv_heads"]
    dim, dtype = MODEL["dim"] // heads, torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(2)
    lengths = partition_sequence(SEQ_LEN, k, "even")
    units = [Unit(0, j, sum(lengths[:j]), n, k) for j, n in enumerate(lengths)]

    def projected(n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """q and every layer's k, v of n tokens, (1, n, H, D), and dout (1, Hq, n, D)."""
        shapes = [heads] + [kv_heads, kv_heads] * layers
        leaves = [torch.randn(1, n, h, dim, generator=g).to(device, dtype).requires_grad_() for h in shapes]
        return leaves, torch.randn(1, heads, n, dim, generator=g).to(device, dtype)

    def chain(attend: Callable, leaves: list[torch.Tensor]) -> torch.Tensor:
        x = leaves[0].transpose(1, 2)
        for i in range(layers):
            x = attend(i, x, leaves[1 + 2 * i].transpose(1, 2), leaves[2 + 2 * i].transpose(1, 2))
        return x

    per_unit, whole = [projected(u.length) for u in units], projected(SEQ_LEN)
    context = KVContext(lengths)  # a microbatch's slabs go with its last backward
    attention = [SequenceAttention(i) for i in range(layers)]
    for layer in attention:
        layer.bind(context, _kernel(kernel) if kernel else select_kernel(device))

    def units_path() -> None:
        outs = []
        for u, (leaves, _) in zip(units, per_unit):
            with context.running(u):
                outs.append(chain(lambda i, q, k_, v: attention[i](q, k_, v), leaves))
        for u in reversed(units):
            with context.backward(u):
                torch.autograd.grad(outs[u.index], per_unit[u.index][0], per_unit[u.index][1])

    def sdpa() -> None:
        sdpa_attention = torch.nn.functional.scaled_dot_product_attention
        out = chain(lambda i, q, k_, v: sdpa_attention(q, k_, v, is_causal=True, enable_gqa=True), whole[0])
        torch.autograd.grad(out, whole[0], whole[1])

    return units_path, sdpa


ARENA_MICROBATCHES = 4
"""Microbatches of the shared-arena measure (Seq1F1B's first stage of 2): enough for a microbatch in
backward to share an arena with the next in forward, from its other end (positions descending)."""


def arena_steps(
    device: torch.device = CPU, kernel: str | None = None
) -> tuple[Callable[[], None], Callable[[], None], int]:
    """One attention layer of the model's shape run as Seq1F1B's first stage runs its units (p 2,
    ARENA_MICROBATCHES microbatches of one sequence, K units), as closures: the KV context told the
    stage's passes (microbatches share arenas, every other one from the top: its slab descending) and
    not told (a slab of its own each, ascending); and the unit-layers whose slab is descending."""
    from torchtitan_seq.attention import SequenceAttention
    from torchtitan_seq.attention.kernels import select_kernel
    from torchtitan_seq.runtime.kv_context import KVContext, Unit
    from torchtitan_seq.runtime.partition import partition_sequence
    from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
    from torchtitan_seq.schedules.ordering import stage_passes

    heads, kv_heads = MODEL["n_heads"], MODEL["n_kv_heads"]
    dim, dtype = MODEL["dim"] // heads, torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = partition_sequence(SEQ_LEN, K, "even")
    offsets = [sum(lengths[:j]) for j in range(K)]
    order = SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(2, ARENA_MICROBATCHES, K))
    passes = stage_passes(order[0], 0, K)[1]
    g = torch.Generator().manual_seed(3)
    # Per microbatch and unit: q, k, v (1, H, L, D) laid out (1, L, H, D), as a unit's projections make them.
    qkv = {
        (m, j): [
            torch.randn(1, n, h, dim, generator=g).to(device, dtype).transpose(1, 2)
            for h in (heads, kv_heads, kv_heads)
        ]
        for m in range(ARENA_MICROBATCHES)
        for j, n in enumerate(lengths)
    }

    def run(told: bool) -> tuple[Callable[[], None], KVContext]:
        context, layer = KVContext(lengths), SequenceAttention(0)
        if told:
            context.expect(passes)
        layer.bind(context, _kernel(kernel) if kernel else select_kernel(device))

        def step() -> None:
            outs, leaves = {}, {}
            for forward, m, j in passes:
                unit = Unit(m, j, offsets[j], lengths[j], K)
                if forward:
                    leaves[m, j] = [t.detach().requires_grad_() for t in qkv[m, j]]
                    with context.running(unit):
                        outs[m, j] = layer(*leaves[m, j], enable_gqa=True)
                else:
                    with context.backward(unit):
                        torch.autograd.grad(outs.pop((m, j)), leaves.pop((m, j)), qkv[m, j][0])
            context.clear()  # as a stage ends its step

        return step, context

    (told, context), (untold, _) = run(True), run(False)
    descending: set[int] = set()
    append = context.append

    def noting(layer_id, k, v, *args, **kwargs):
        slab, stored = append(layer_id, k, v, *args, **kwargs)
        if slab.descending:
            descending.add(context.unit.microbatch)
        return slab, stored

    context.append = noting
    told()
    del context.append
    return told, untold, len(descending) * K


def launches(fn: Callable[[], object], device: torch.device) -> int:
    """Kernel launches of ``fn``: on a GPU the profiler's device events (kernels, memcpy, memset), on
    the CPU its leaf aten ops (:func:`leaf_ops`)."""
    if device.type != "cuda":
        return leaf_ops(fn)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def _best_us(step: Callable[[], None], repeats: int, device: torch.device) -> tuple[float, float]:
    """The least host µs of ``step`` over ``repeats`` (on a GPU its issue time: nothing waits for the
    device inside it; on the CPU the CPU time of this thread, which runs the whole step with one
    thread: the time other work on a shared machine takes the core is not counted), and the least
    device µs (CUDA events around it; on the CPU the host's)."""
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    host = gpu = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = clock()
        step()
        host = min(host, clock() - began)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            gpu = min(gpu, start.elapsed_time(end) * 1e-3)
        else:
            gpu = host
    return host * 1e6, gpu * 1e6


ATTENTION_LAYERS = (2, 4)
"""Attention layers chained per unit in the unit path's own measure: the difference between them is
per layer (what a unit pays once, its autograd call, cancels)."""


def _own(best: dict[str, float], units: str, whole: str) -> float:
    """Per unit and layer added: (units minus whole) at the most layers minus at the fewest, over the layers
    between and K - 1 units."""
    a, b = ATTENTION_LAYERS
    added = (best[f"{units}_{b}"] - best[f"{whole}_{b}"]) - (best[f"{units}_{a}"] - best[f"{whole}_{a}"])
    return added / (b - a) / (K - 1)


def _alternating(runs: dict, repeats: int, device: torch.device) -> dict:
    """The least host µs of each of ``runs`` (closures) over ``repeats``, after a warm-up, taking turns
    so that a slower spell of the machine meets them all."""
    best = {name: float("inf") for name in runs}
    for fn in runs.values():
        fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            best[name] = min(best[name], _best_us(fn, 1, device)[0])
    return best


def _per_unit_layer(figures: dict[str, float]) -> dict[str, float]:
    """Figures of the steps at k = 1 and K and of the plain models of 2 and 4 layers -> per unit-layer (k = K
    minus k = 1, over the unit-layers added) and per plain layer."""
    return {"unit": (figures["k"] - figures["k1"]) / UNIT_LAYERS, "plain": (figures["4"] - figures["2"]) / 2}


def measure(repeats: int, device: torch.device = CPU) -> dict:
    """This checkout's figures on ``device`` (see the module docstring), per unit-layer and per plain layer."""
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = {"k1": pipeline_step(1, device=device), "k": pipeline_step(K, device=device)}
        runs |= {str(n): plain_step(n, device) for n in (2, 4)}
        for fn in runs.values():
            fn()  # warm-up: shape inference, first allocations
        count = _per_unit_layer({name: launches(fn, device) for name, fn in runs.items()})
        record = {"device": str(device), "launches_per_unit_layer": count}
        kernels = (lambda fn: launches(fn, device)) if device.type == "cuda" else partial(leaf_ops, through_views=True)
        if device.type != "cuda":
            record["leaf_ops_through_views"] = _per_unit_layer({name: kernels(fn) for name, fn in runs.items()})
        told, untold, descending = arena_steps(device)
        untold()
        record["descending_slab_launches_per_unit_layer"] = (kernels(told) - kernels(untold)) / descending
        if device.type != "cuda":  # the CUDA adapters' op sequences, against fakes of their aten ops
            with _fake_cuda_ops():
                for kernel in ADAPTERS:
                    fake = {"k1": pipeline_step(1, kernel), "k": pipeline_step(K, kernel), "2": 0.0, "4": 0.0}
                    for name in ("k1", "k"):
                        fake[name]()
                        fake[name] = leaf_ops(fake[name])
                    count[kernel] = _per_unit_layer(fake)["unit"]
        times = {name: _best_us(fn, repeats, device) for name, fn in runs.items()}
        for i, name in enumerate(("host", "device")):
            record[f"{name}_us_per_unit_layer"] = _per_unit_layer({run: t[i] for run, t in times.items()})
        runs = {}
        for n in ATTENTION_LAYERS:
            runs[f"units_{n}"], runs[f"sdpa_{n}"] = attention_steps(device, layers=n)
        best = _alternating(runs, repeats, device)
        record["attention_host_us"] = best
        record["unit_path_host_us"] = _own(best, "units", "sdpa")
        if device.type != "cuda":  # the CUDA adapters' op sequences, their kernels costing the host a launch
            record["unit_path_host_us_launch_fakes"] = {}
            with _fake_cuda_ops(compute=False):
                for kernel in ADAPTERS:
                    runs = {
                        f"k{k}_{n}": attention_steps(device, k, kernel, n)[0] for k in (1, K) for n in ATTENTION_LAYERS
                    }
                    record["unit_path_host_us_launch_fakes"][kernel] = _own(
                        _alternating(runs, repeats, device), f"k{K}", "k1"
                    )
    finally:
        dist.destroy_process_group()
    return record


def _run_tree(tree: Path, repeats: int) -> dict:
    """This script's measurement of the checkout ``tree`` (its ``torchtitan_seq``), in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(Path(__file__).resolve()), "--count", "--repeats", str(repeats)]
    out = subprocess.run(argv, env=env, cwd=tree, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _descending(run: dict) -> str:
    """A run's kernels per descending unit-layer over ascending, or "-" (a checkout from before it was measured)."""
    figure = run.get("descending_slab_launches_per_unit_layer")
    return "-" if figure is None else f"{figure:.1f}"


def table(runs: list[dict], trees: list[Path]) -> str:
    """Per tree: leaf ops per unit-layer (CPU kernel, cuDNN and flash adapters) against a plain layer,
    and the least host µs over the rounds: per unit-layer of the step (a plain layer's, compute
    included), and the unit path's own (K units' attention minus SDPA's on the whole sequence; with the
    CUDA adapters against fakes that compute nothing, K units' minus one's)."""
    lines = [
        "| tree | leaf ops / unit-layer: CPU, cuDNN, flash (plain layer) | host µs / unit-layer (plain layer) | "
        f"attention µs, {ATTENTION_LAYERS[-1]} layers: {K} units, SDPA whole | "
        "unit path's own µs / unit-layer added: CPU; cuDNN, flash (launch fakes) | "
        "kernels / descending unit-layer, over ascending |",
        "|---|---|---|---|---|---|",
    ]
    for tree in trees:
        mine = [r for r in runs if r["tree"] == str(tree)]
        ops = mine[0]["launches_per_unit_layer"]
        unit = min(r["host_us_per_unit_layer"]["unit"] for r in mine)
        plain = min(r["host_us_per_unit_layer"]["plain"] for r in mine)
        most = ATTENTION_LAYERS[-1]
        units, sdpa = (min(r["attention_host_us"][f"{name}_{most}"] for r in mine) for name in ("units", "sdpa"))
        own = min(r["unit_path_host_us"] for r in mine)
        fakes = [min(r["unit_path_host_us_launch_fakes"][k] for r in mine) for k in ADAPTERS]
        lines.append(
            f"| {tree} | {ops['unit']:.1f}, {ops['CudnnSdpaKernel']:.1f}, {ops['CudaSdpaKernel']:.1f} "
            f"({ops['plain']:.1f}) | {unit:.0f} ({plain:.0f}) | {units:.0f}, {sdpa:.0f} | {own:.0f}; "
            f"{fakes[0]:.0f}, {fakes[1]:.0f} | {_descending(mine[0])} |"
        )
    loads = [r["load"] for r in runs]
    lines.append(f"\nLoad average (1 min) before each run: {min(loads):.2f} to {max(loads):.2f}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", type=Path, nargs=2, help="two checkouts, before and after")
    ap.add_argument("--count", action="store_true", help="measure this interpreter's torchtitan_seq, print JSON")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="with --count")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.count or not args.trees:
        record = {"load": os.getloadavg()[0], **measure(args.repeats, torch.device(args.device))}
        print(json.dumps(record))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"unit_host_{args.device}.json").write_text(json.dumps(record, indent=1))
        return
    runs = []
    for r in range(args.rounds):
        for tree in args.trees if r % 2 == 0 else reversed(args.trees):
            load = os.getloadavg()[0]
            runs.append({"round": r, "tree": str(tree), **_run_tree(tree, args.repeats), "load": load})
            print(json.dumps(runs[-1]), flush=True)
    report = table(runs, args.trees)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "unit_host.json").write_text(json.dumps(runs, indent=1))
        (args.out / "unit_host.md").write_text(report)


if __name__ == "__main__":
    main()
