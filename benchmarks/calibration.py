"""Calibration for ``bench.py --calibrate``: measured unit times as a cost file of
:mod:`torchtitan_seq.simulate` (seconds), see :func:`calibrate`."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
from torchtitan.config import Parallelism
from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

from torchtitan_seq.attention import bind_kv_context
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.instrumentation.memory import ActivationMemory
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer, seq_llama3_flavors

__all__ = ["calibrate", "merge"]


def _stage_model(flavor: str, seq_len: int, pp: int, stage: int) -> tuple[torch.nn.Module, object]:
    """Chunk ``stage`` of ``pp`` of the flavor's SeqTransformer, cut as torchtitan's pipeline split
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


class _Chunk:
    """One chunk of the model with its KV context, timing its passes of the units ``lengths``."""

    def __init__(
        self, seq_len: int, lengths: list[int], num_chunks: int, chunk: int, units: bool, flavor: str, dev: torch.device
    ) -> None:
        self.model, args = _stage_model(flavor, seq_len, num_chunks, chunk)
        self.model.to(dev)
        self.first, self.last = chunk == 0, chunk == num_chunks - 1
        self.context = KVContext(lengths)
        if units:
            bind_kv_context(self.model, self.context, select_kernel(dev))
        self.seq_len, self.lengths, self.units, self.dev = seq_len, lengths, units, dev
        self.dim, self.vocab = args.dim, args.vocab_size
        self.offsets = [sum(lengths[:j]) for j in range(len(lengths))]
        self.times: dict[str, list[float]] = {p: [0.0] * len(lengths) for p in "FBIW"}

    def unit(self, j: int) -> Unit:
        return Unit(0, j, self.offsets[j], self.lengths[j], len(self.lengths))

    def start(self) -> None:
        """Fresh inputs (token ids on the first chunk, activations (1, L_j, D) after it) and targets."""
        dev, lengths = self.dev, self.lengths
        if self.first:
            self.inputs = [torch.randint(self.vocab, (1, n), device=dev) for n in lengths]
        else:
            self.inputs = [torch.randn(1, n, self.dim, device=dev, requires_grad=True) for n in lengths]
        self.targets = [torch.randint(self.vocab, (1, n), device=dev) for n in lengths]
        self.outs: list[torch.Tensor] = []

    def forward(self, j: int) -> None:
        def run() -> torch.Tensor:
            with self.context.running(self.unit(j)) if self.units else contextlib.nullcontext():
                out = self.model(self.inputs[j])
            if not self.last:
                return out
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), self.targets[j].flatten(), reduction="sum")
            return loss / self.seq_len

        self.times["F"][j], out = _timed(run, self.dev)
        self.outs.append(out)

    def backward(self, j: int, split: bool) -> None:
        """B of unit j; with ``split``, I then W, with torch's own ``stage_backward*``."""
        if j == len(self.lengths) - 1:
            self.grads = [None if self.last else torch.randn_like(o) for o in self.outs]
        values = [] if self.first else [self.inputs[j]]
        if not split or self.first:
            # The first stage has no input gradient: torch runs its I as nothing and its W as a full backward.
            with self.context.backward(self.unit(j)):
                t, _ = _timed(lambda: stage_backward(self.outs[j], self.grads[j], values), self.dev)
            self.times["W" if split else "B"][j] = t
            return
        grad = None if self.last else (self.grads[j],)
        params = self.model.parameters
        with self.context.backward(self.unit(j), last_pass=False):
            self.times["I"][j], (_, groups) = _timed(
                lambda: stage_backward_input((self.outs[j],), grad, values, params()), self.dev
            )
        with self.context.backward(self.unit(j)):
            self.times["W"][j], _ = _timed(lambda: stage_backward_weight(params(), groups), self.dev)

    def clear(self) -> None:
        self.context.clear()
        self.model.zero_grad(set_to_none=True)


def _round(chunks: list[_Chunk]) -> list[dict[str, list[float]]]:
    """Per round, the units run forward in order and a full backward (B) last unit first, then
    forward again and the split backward; each pass of a unit runs on every chunk of the rank in
    turn, as a rank of several stages alternates between them (their weights and activations
    compete for the caches)."""
    k = len(chunks[0].lengths)
    for split in (False, True):
        for c in chunks:
            c.start()
        for j in range(k):
            for c in chunks:
                c.forward(j)
        for j in reversed(range(k)):
            for c in chunks:
                c.backward(j, split)
        for c in chunks:
            c.clear()
    return [{p: list(ts) for p, ts in c.times.items()} for c in chunks]


def _calibrate_rank(
    seq_len: int,
    lengths: list[int],
    num_chunks: int,
    chunks: list[int],
    units: bool,
    flavor: str,
    repeats: int,
    device: str,
    metered: bool,
    barrier,
) -> list[dict[str, list[float]]]:
    """Median seconds of each pass of each unit on each of one rank's chunks (one process; see
    :func:`calibrate`)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as a training rank on a CPU (run_train.sh's OMP_NUM_THREADS=1)
    torch.manual_seed(chunks[0])
    timers = [_Chunk(seq_len, lengths, num_chunks, c, units, flavor, dev) for c in chunks]
    barrier.wait()
    # The benchmark's runs meter activations in every step (activation_memory_freq = 1): the
    # saved-tensor hook runs on every tensor autograd saves, a cost per operation that many
    # small units pay more often, so the calibration pays it too (unless not ``metered``).
    with ActivationMemory().track() if metered else contextlib.nullcontext():
        _round(timers)  # allocations, kernel choice
        rounds = []
        for _ in range(repeats):
            barrier.wait()  # every rank times its passes while the others run theirs
            rounds.append(_round(timers))
    return [
        {p: [statistics.median(r[i][p][j] for r in rounds) for j in range(len(lengths))] for p in "FBIW"}
        for i in range(len(chunks))
    ]


def calibrate(
    seq_len: int,
    lengths: list[int],
    pp: int,
    *,
    units: bool,
    chunks: list[list[int]] | None = None,
    flavor: str = "debugmodel",
    repeats: int = 3,
    device: str = "cpu",
    metered: bool = True,
) -> dict:
    """Seconds of each pass of each unit on the slowest rank: the simulator's cost file.

    Each of the ``pp`` ranks runs in its own process, all at once, as the
    training ranks share the machine (on a CPU they contend for cores and
    memory bandwidth). ``chunks``: per rank, the model chunks it holds, of as
    many chunks as the lists name (default: one per rank, ``[[0], [1], ...]``),
    each cut as torchtitan cuts the model; a rank of several chunks runs each
    pass on all of them in turn (:func:`_round`). ``units``: run subsequences
    ``lengths`` through a KV context, as a sequence schedule does; otherwise
    the whole sequence with plain attention, as torch's schedules do
    (``lengths`` is then ``[seq_len]``). Per round, the units run forward in
    order and a full backward (B) last unit first, then forward again and the
    split backward: input gradients (I), then weight gradients (W), with
    torch's own ``stage_backward*`` functions, as the pipeline stage runs them.
    The last chunk's loss (sum cross-entropy over the sequence) counts as
    forward. Median of ``repeats`` rounds after one untimed round, all under
    the activation meter the benchmark's instrumented runs have on every step
    (:mod:`torchtitan_seq.instrumentation.memory`; ``--instrumentation off`` runs are
    predicted from these metered times too), or, not ``metered``, without it
    (what the meter costs a unit, against a metered calibration).

    A rank's times are its chunks' mean scaled to 1/pp of the layers (the
    simulator's unit: it gives a stage of c chunks' share pp / c of them).
    F, B, I and W are the slowest rank's (largest total F + B), ``stage``:
    the times the simulator gives every stage unless ``chunk_times`` (every
    chunk's own, per rank) cover the schedule's layout, when each stage takes
    its own chunk's (:func:`torchtitan_seq.simulate.costs.unit_and_chunk_times`);
    ``stages`` keeps every rank's.
    """
    chunks = chunks or [[r] for r in range(pp)]
    num_chunks = 1 + max(c for held in chunks for c in held)
    ctx = torch.multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(pp) as pool:
        barrier = manager.Barrier(pp)
        work = [
            (seq_len, lengths, num_chunks, held, units, flavor, repeats, device, metered, barrier) for held in chunks
        ]
        chunk_times = pool.starmap(_calibrate_rank, work)
    meta = {
        "unit": "s",
        "seq_len": seq_len,
        "lengths": lengths,
        "flavor": flavor,
        "repeats": repeats,
        "device": device,
        "metered": metered,
    }
    return _cost_file(chunks, chunk_times, meta)


def _cost_file(chunks: list[list[int]], chunk_times: list[list[dict[str, list[float]]]], meta: dict) -> dict:
    """The cost file of :func:`calibrate` from every chunk's times (seconds per pass and unit)."""
    pp, num_chunks = len(chunks), 1 + max(c for held in chunks for c in held)
    scale = num_chunks / pp
    ranks = [
        {p: [scale * statistics.mean(t[p][j] for t in times) for j in range(len(meta["lengths"]))] for p in "FBIW"}
        for times in chunk_times
    ]
    slowest = max(range(pp), key=lambda r: sum(ranks[r]["F"]) + sum(ranks[r]["B"]))
    return {**ranks[slowest], "stage": slowest, "stages": ranks, "chunks": chunks, "chunk_times": chunk_times, **meta}


def merge(costs: list[dict]) -> dict:
    """One cost file from calibrations of the same units and layout taken at different times
    (``bench.py`` calibrates in every round, beside the runs): the median of each pass of each
    unit on each chunk, then :func:`calibrate`'s derivation; ``rounds`` says how many."""
    first = costs[0]
    chunk_times = [
        [
            {
                p: [
                    statistics.median(c["chunk_times"][r][i][p][j] for c in costs) for j in range(len(first["lengths"]))
                ]
                for p in "FBIW"
            }
            for i in range(len(held))
        ]
        for r, held in enumerate(first["chunks"])
    ]
    meta = {key: first[key] for key in ("unit", "seq_len", "lengths", "flavor", "repeats", "device", "metered")}
    return {**_cost_file(first["chunks"], chunk_times, meta), "rounds": len(costs)}
