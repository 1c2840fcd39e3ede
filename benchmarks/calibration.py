"""Calibration for ``bench.py --calibrate``: measured unit times as a cost file of
:mod:`torchtitan_seq.simulate` (seconds), see :func:`calibrate`."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable

import torch
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
from torchtitan.config import Parallelism
from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

from torchtitan_seq.attention import bind_kv_context, select_kernel
from torchtitan_seq.kv_context import KVContext, Unit
from torchtitan_seq.models.llama3_seq import SeqTransformer, seq_llama3_flavors

__all__ = ["calibrate"]


def _stage_model(flavor: str, seq_len: int, pp: int, stage: int) -> tuple[torch.nn.Module, object]:
    """Stage ``stage`` of ``pp`` of the flavor's SeqTransformer, cut as torchtitan's pipeline split
    cuts it (its default first- and last-stage weights), and the model args."""
    args = dataclasses.replace(seq_llama3_flavors[flavor], max_seq_len=seq_len)
    defaults = Parallelism()
    keep = set(
        generate_llm_fqn_per_model_part(
            pp,
            args.n_layers,
            defaults.pipeline_parallel_first_stage_less_layers,
            defaults.pipeline_parallel_last_stage_less_layers,
        )[stage]
    )
    model = SeqTransformer(args)
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.ModuleDict):
            for layer in list(child):
                if f"{name}.{layer}" not in keep:
                    del child[layer]
        elif name not in keep:
            setattr(model, name, None)
    return model, args


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def _calibrate_stage(
    seq_len: int,
    lengths: list[int],
    pp: int,
    stage: int,
    units: bool,
    flavor: str,
    repeats: int,
    device: str,
    barrier,
) -> dict[str, list[float]]:
    """Median seconds of each pass of each unit on one stage (one process; see :func:`calibrate`)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as a training rank on a CPU (run_train.sh's OMP_NUM_THREADS=1)
    torch.manual_seed(stage)
    model, model_args = _stage_model(flavor, seq_len, pp, stage)
    model.to(dev)
    first, last = stage == 0, stage == pp - 1
    context = KVContext()
    if units:
        bind_kv_context(model, context, select_kernel(dev))
    k = len(lengths)
    offsets = [sum(lengths[:j]) for j in range(k)]
    dim, vocab = model_args.dim, model_args.vocab_size

    def unit(j: int) -> Unit:
        return Unit(0, j, offsets[j], lengths[j], k)

    def forward(j: int, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with context.running(unit(j)) if units else contextlib.nullcontext():
            out = model(x)
        if not last:
            return out
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum")
        return loss / seq_len

    def one_round() -> dict[str, list[float]]:
        if first:
            inputs = [torch.randint(vocab, (1, n), device=dev) for n in lengths]
        else:
            inputs = [torch.randn(1, n, dim, device=dev, requires_grad=True) for n in lengths]
        targets = [torch.randint(vocab, (1, n), device=dev) for n in lengths]
        times: dict[str, list[float]] = {p: [0.0] * k for p in "FBIW"}
        for split in (False, True):
            outs = []
            for j in range(k):
                times["F"][j], out = _timed(lambda: forward(j, inputs[j], targets[j]), dev)
                outs.append(out)
            grads = [None if last else torch.randn_like(o) for o in outs]
            values = [[] if first else [x] for x in inputs]
            for j in reversed(range(k)):
                if not split or first:
                    # The first stage has no input gradient: torch runs its I as nothing
                    # and its W as a full backward.
                    with context.backward(unit(j)):
                        t, _ = _timed(lambda: stage_backward(outs[j], grads[j], values[j]), dev)
                    times["W" if split else "B"][j] = t
                    continue
                out = (outs[j],)
                grad = None if last else (grads[j],)
                with context.backward(unit(j), last_pass=False):
                    times["I"][j], (_, groups) = _timed(
                        lambda: stage_backward_input(out, grad, values[j], model.parameters()), dev
                    )
                with context.backward(unit(j)):
                    times["W"][j], _ = _timed(
                        lambda: stage_backward_weight(model.parameters(), groups), dev
                    )
            context.clear()
            model.zero_grad(set_to_none=True)
        return times

    barrier.wait()
    one_round()  # allocations, kernel choice
    rounds = []
    for _ in range(repeats):
        barrier.wait()  # every stage times its passes while the others run theirs
        rounds.append(one_round())
    return {p: [statistics.median(r[p][j] for r in rounds) for j in range(k)] for p in "FBIW"}


def calibrate(
    seq_len: int,
    lengths: list[int],
    pp: int,
    *,
    units: bool,
    flavor: str = "debugmodel",
    repeats: int = 3,
    device: str = "cpu",
) -> dict:
    """Seconds of each pass of each unit on the slowest stage: the simulator's cost file.

    Each of the ``pp`` stages runs in its own process, all at once, as the
    training ranks share the machine (on a CPU they contend for cores and
    memory bandwidth), each rank's stage cut as torchtitan cuts the model.
    ``units``: run subsequences ``lengths`` through a KV context, as a
    sequence schedule does; otherwise the whole sequence with plain attention,
    as torch's schedules do (``lengths`` is then ``[seq_len]``). Per round,
    the units run forward in order and a full backward (B) last unit first,
    then forward again and the split backward: input gradients (I), then
    weight gradients (W), with torch's own ``stage_backward*`` functions, as
    the pipeline stage runs them. The last stage's loss (sum cross-entropy over
    the sequence) counts as forward. Median of ``repeats`` rounds after one
    untimed round. The simulator gives every stage the same costs: F, B, I
    and W are those of the slowest stage (largest total F + B), ``stage``;
    ``stages`` keeps every stage's.
    """
    ctx = torch.multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(pp) as pool:
        barrier = manager.Barrier(pp)
        work = [(seq_len, lengths, pp, s, units, flavor, repeats, device, barrier) for s in range(pp)]
        stages = pool.starmap(_calibrate_stage, work)
    slowest = max(range(pp), key=lambda s: sum(stages[s]["F"]) + sum(stages[s]["B"]))
    return {
        **stages[slowest],
        "stage": slowest,
        "stages": stages,
        "unit": "s",
        "seq_len": seq_len,
        "lengths": lengths,
        "flavor": flavor,
        "repeats": repeats,
        "device": device,
    }
