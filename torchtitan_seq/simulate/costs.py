"""Cost models of the simulator: how long each pass of each unit takes, and unit lengths.

Time is measured in forwards of one whole microbatch on a stage holding 1/p of
the layers (:mod:`.engine` scales to 1/V of a rank's layers, V stages per
rank). Unit j of length L_j after a prefix P_j costs:

- ``uniform``: F = L_j / S, B = 2 F, I = W = F (S the sequence length);
- ``transformer``: :class:`~torchtitan_seq.runtime.partition.UnitCost` of the model
  flavor: F = forward(L_j, P_j), I = backward_input, W = backward_weight,
  B = I + W, divided by forward(S, 0); with ``document_length`` D > 0 attention
  scores the pairs of packed documents D tokens long on average;
- a JSON file of measured times of one unit on a stage with 1/p of the layers,
  one entry per subsequence j::

      {"F": [t_0, ..., t_{k-1}], "B": [...], "I": [...], "W": [...]}

  ``F`` is required, and ``B`` or both ``I`` and ``W``; ``B`` defaults to
  I + W; ``I`` and ``W`` are needed only by schedules that split backward.
  Times are in any one unit (seconds, ms); a network whose links cost time
  (:mod:`.network`) needs them in seconds, marked ``"unit": "s"`` (as
  ``bench.py --calibrate`` writes them). A calibration file also holds each
  model chunk's own times on each rank (``chunks``, ``chunk_times``):
  :func:`unit_and_chunk_times` reads them, and the engine times every stage as its own
  chunk (the first and last carry the embedding and the output layer) where
  they cover the schedule's stages. Other keys (metadata) are ignored.

:func:`seconds_per_time_unit` converts the unit of time into seconds for a
network.

What a unit costs beyond its share of the sequence: :func:`fit_unit_costs` fits
measured units' F + B to a fixed cost per unit plus a cost per token and per
(query, key) pair (:class:`UnitCostFit`; :func:`fit_cost_files` on calibration
files). The 'transformer' cost has no fixed cost; ``SimConfig.unit_overhead``
adds one (seconds per layer, as :attr:`UnitCostFit.fixed` over the layers of the
stage it was measured on), shared between a unit's passes in proportion to them.

Context parallelism (``network.context_parallel`` c): a rank computes 1/c of each unit (the cost
models' time unit then spans c GPUs; measured times are divided by c) and every layer adds the
all-gather of the unit's K/V to F and the reduce-scatter of their gradient to B (or I), as
:meth:`~.network.Network.kv_collective_seconds` times them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from torchtitan_seq.runtime.partition import UnitCost
from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.schedules.ordering import B, F, I, W
from torchtitan_seq.simulate.build import SimConfig
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.titan.flavors import ModelShape, flavor_shapes

if TYPE_CHECKING:
    from torchtitan.models.llama3 import TransformerModelArgs

__all__ = [
    "UnitTimes",
    "ChunkTimes",
    "unit_times",
    "unit_and_chunk_times",
    "transformer_times",
    "job_shape",
    "subsequence_lengths",
    "model_args",
    "seconds_per_time_unit",
    "UnitCostFit",
    "fit_unit_costs",
    "fit_cost_files",
    "stage_times",
]


@dataclass(frozen=True)
class UnitTimes:
    """Time of each pass of unit j on a stage holding 1/p of the layers.

    Each field is indexed by subsequence j. ``I`` and ``W`` are None when
    unknown (a cost file without them); schedules that split backward need them.
    """

    F: tuple[float, ...]
    B: tuple[float, ...]
    I: tuple[float, ...] | None = None  # noqa: E741
    W: tuple[float, ...] | None = None


ChunkTimes = dict[tuple[int, int, int], UnitTimes]
"""(rank, model chunk, chunk count) -> the chunk's measured times on that rank, for a stage running
it (unscaled), the model cut into that many chunks."""


def unit_times(config: SimConfig, lengths: list[int]) -> UnitTimes:
    """Per-unit times of ``config.cost`` for subsequences ``lengths`` (see the module docstring),
    with ``config.recompute`` forwards added to each backward (B, and I: it runs first)."""
    return unit_and_chunk_times(config, lengths)[0]


def unit_and_chunk_times(config: SimConfig, lengths: list[int]) -> tuple[UnitTimes, ChunkTimes]:
    """:func:`unit_times` and, from a calibration file that timed every model chunk, each chunk's
    own times (empty for the cost models and for files without them), recomputation added alike;
    the file is read once."""
    k, chunks = len(lengths), {}
    if config.cost == "uniform":
        fwd = tuple(length / sum(lengths) for length in lengths)
        times = UnitTimes(F=fwd, B=tuple(2 * t for t in fwd), I=fwd, W=fwd)
    elif config.cost == "transformer":
        times = transformer_times(_model_cost(config), lengths)
        if config.unit_overhead:
            layers = model_args(config).n_layers / config.pp  # the time unit's stage
            times = _with_fixed_cost(times, config.unit_overhead * layers / seconds_per_time_unit(config))
    else:
        data = _read(Path(config.cost))
        times = _parse(data, k, config.cost)
        count = 1 + max((c for held in data.get("chunks", []) for c in held), default=-1)
        chunks = {
            (rank, chunk, count): _parse(measured, k, config.cost)
            for rank, (held, per_chunk) in enumerate(zip(data.get("chunks", []), data.get("chunk_times", [])))
            for chunk, measured in zip(held, per_chunk)
        }
    recompute = config.recompute
    times, chunks = _recomputing(times, recompute), {key: _recomputing(t, recompute) for key, t in chunks.items()}
    if config.network.context_parallel > 1:  # after recomputation, which gathers nothing
        cp = _context_parallel(config, lengths)
        times, chunks = cp(times), {key: cp(t) for key, t in chunks.items()}
    return times, chunks


def _context_parallel(config: SimConfig, lengths: list[int]) -> Callable[[UnitTimes], UnitTimes]:
    """Under CP (``config.network.context_parallel`` c): a CP rank computes 1/c of each unit (measured
    times, taken without CP, divided by c; the cost models' time unit already counts c GPUs a
    microbatch), and each of the time unit's layers all-gathers the unit's K/V in F and
    reduce-scatters their gradient in its backward's first pass (B, or I)."""
    network = config.network
    measured = config.cost not in ("uniform", "transformer")
    share = 1 / network.context_parallel if measured else 1.0
    comm = (0.0,) * len(lengths)
    if not network.free:
        layers = model_args(config).n_layers / config.pp  # the time unit's stage
        unit = seconds_per_time_unit(config)
        comm = tuple(layers * network.kv_collective_seconds(model_args(config), n) / unit for n in lengths)

    def split(times: UnitTimes) -> UnitTimes:
        def plus(passes: tuple[float, ...] | None, add: bool) -> tuple[float, ...] | None:
            if passes is None:
                return None
            return tuple(t * share + (x if add else 0.0) for t, x in zip(passes, comm))

        return UnitTimes(F=plus(times.F, True), B=plus(times.B, True), I=plus(times.I, True), W=plus(times.W, False))

    return split


def _with_fixed_cost(times: UnitTimes, fixed: float) -> UnitTimes:
    """``fixed`` more on each unit's F + B, shared between its passes in proportion to them."""

    def plus(passes: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if passes is None:
            return None
        return tuple(t * (1 + fixed / (f + b)) for t, f, b in zip(passes, times.F, times.B))

    return UnitTimes(F=plus(times.F), B=plus(times.B), I=plus(times.I), W=plus(times.W))


def _recomputing(times: UnitTimes, recompute: float) -> UnitTimes:
    """``recompute`` forwards added to each backward (B, and I: it runs first)."""
    if not recompute:
        return times

    def plus_forwards(passes: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return None if passes is None else tuple(t + recompute * f for t, f in zip(passes, times.F))

    return UnitTimes(F=times.F, B=plus_forwards(times.B), I=plus_forwards(times.I), W=times.W)


def transformer_times(cost: UnitCost, lengths: list[int]) -> UnitTimes:
    """The 'transformer' times of subsequences ``lengths`` under ``cost``: each pass's cost
    over a whole sequence's forward."""
    norm = cost.forward(sum(lengths), 0)
    prefixes = [sum(lengths[:j]) for j in range(len(lengths))]

    def per_unit(pass_cost: Callable[[float, float], float]) -> tuple[float, ...]:
        return tuple(pass_cost(length, p) / norm for length, p in zip(lengths, prefixes))

    inp, wgt = per_unit(cost.backward_input), per_unit(cost.backward_weight)
    return UnitTimes(F=per_unit(cost.forward), B=tuple(i + w for i, w in zip(inp, wgt)), I=inp, W=wgt)


@dataclass(frozen=True)
class UnitCostFit:
    """A unit's forward + backward time as ``fixed + per_token * s + per_pair * pairs(s, P)``
    for s tokens after a prefix of P, pairs being the (query, key) pairs attention scores
    (:meth:`~torchtitan_seq.runtime.partition.UnitCost.pairs`: causal, or packed documents of
    ``document_length`` tokens on average). ``fixed`` is what a unit costs beyond its share
    of the sequence: launches, host work, per-call merges, whatever does not shrink with it."""

    fixed: float
    per_token: float
    per_pair: float
    document_length: float | None = None

    def __call__(self, length: float, prefix: float) -> float:
        pairs = UnitCost(0.0, 0.0, self.document_length).pairs(length, prefix)
        return self.fixed + self.per_token * length + self.per_pair * pairs

    def fixed_share(self, lengths: list[int]) -> float:
        """The fixed cost's share of a cut into ``lengths``: k x fixed over the k units' fitted
        F + B. Every stage runs each unit of each microbatch once a step, so this is also the
        share of a stage's compute time in the step (its busy time, bubbles apart)."""
        prefixes = [sum(lengths[:j]) for j in range(len(lengths))]
        return len(lengths) * self.fixed / sum(self(n, p) for n, p in zip(lengths, prefixes))


def fit_unit_costs(units: Iterable[tuple[float, float, float]], document_length: float | None = None) -> UnitCostFit:
    """Least-squares :class:`UnitCostFit` of measured units, each ``(length, prefix, F + B)``.
    Relative residuals are minimised, so that short units weigh as much as long ones. The
    fixed cost is at least 0: where longer units cost more than linearly in their tokens (on a
    CPU, whose caches they outgrow) the best fit with none is taken. Raises ValueError when the
    units cannot tell the three terms apart (e.g. one even cut alone: every unit has the same
    length, so fixed and per-token cost are one)."""
    pairs = UnitCost(0.0, 0.0, document_length).pairs
    rows = [(1.0, float(n), pairs(n, p), t) for n, p, t in units]
    a = np.array([r[:3] for r in rows], dtype=np.float64)
    y = np.array([r[3] for r in rows], dtype=np.float64)
    scale = np.abs(a).max(axis=0) if len(rows) else np.ones(3)
    if len(rows) < 3 or np.linalg.matrix_rank(a / scale) < 3:
        raise ValueError(
            f"{len(rows)} units cannot separate a fixed cost from the costs per token and per pair: "
            "give units of at least two different lengths (e.g. two cuts, or the whole sequence and a cut)"
        )
    weighted = a / scale / y[:, None]  # relative residuals: (a c - y) / y
    coef = np.linalg.lstsq(weighted, np.ones_like(y), rcond=None)[0] / scale
    if coef[0] < 0:  # the least squares with fixed >= 0 has it at 0 (one bound, a convex fit)
        coef = np.concatenate([[0.0], np.linalg.lstsq(weighted[:, 1:], np.ones_like(y), rcond=None)[0] / scale[1:]])
    return UnitCostFit(float(coef[0]), float(coef[1]), float(coef[2]), document_length)


def fit_cost_files(paths: Iterable[Path], document_length: float | None = None) -> UnitCostFit:
    """:func:`fit_unit_costs` of every unit in cost files (``F``, ``B`` and ``lengths``, as
    ``bench.py --calibrate`` and the GPU check write them), their times as they are (one
    stage's layers: the files should be of one model cut alike)."""
    units = []
    for path in paths:
        data = _read(Path(path))
        prefix = 0
        for n, f, b in zip(data["lengths"], data["F"], data["B"]):
            units.append((n, prefix, f + b))
            prefix += n
    return fit_unit_costs(units, document_length)


GPU_FIT_MIN_SEQ_LEN = 16384
"""The shortest sequence whose GPU-check cost files :func:`gpu_fixed_cost_per_layer` fits: at 8K on an
H200 units of 1-2K tokens are not linear in their tokens, and the fit's per-token cost turns negative."""


def gpu_fixed_cost_per_layer(folder: Path) -> float:
    """Seconds a unit's forward + backward costs per layer beyond its share of the FLOPs, from the cost
    files a GPU check writes (``benchmarks/gpu_check.sh`` into ``benchmarks/gpu/DATE/KERNEL``): the
    fixed cost of :func:`fit_cost_files` over those of sequences of at least
    :data:`GPU_FIT_MIN_SEQ_LEN` tokens, over their model's layers. The planner's
    ``H200_UNIT_OVERHEAD_S`` is this of the newest committed check's cuDNN files."""
    data = {p: _read(p) for p in sorted(Path(folder).glob("cost_s*.json"))}
    files = [p for p, d in data.items() if d["seq_len"] >= GPU_FIT_MIN_SEQ_LEN]
    if not files:
        raise ValueError(f"{folder}: no cost files of {GPU_FIT_MIN_SEQ_LEN} tokens or more")
    models = {data[p]["model"] for p in files}
    if len(models) != 1:
        raise ValueError(f"{folder}: cost files of {len(models)} models; a fit needs one")
    layers = json.loads(models.pop().removeprefix("llama3 "))["n_layers"]
    return fit_cost_files(files).fixed / layers


def _read(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"--cost {path}: not 'uniform', 'transformer' or an existing JSON file")
    return json.loads(path.read_text())


def _parse(data: dict, k: int, path: str) -> UnitTimes:
    passes: dict[str, tuple[float, ...] | None] = {}
    for name in ("F", "B", "I", "W"):
        times = data.get(name)
        if times is not None and len(times) != k:
            raise ValueError(f"{path}: {name!r} has {len(times)} times, the schedule has {k} subsequences")
        passes[name] = None if times is None else tuple(float(t) for t in times)
    if passes["B"] is None and passes["I"] is not None and passes["W"] is not None:
        passes["B"] = tuple(i + w for i, w in zip(passes["I"], passes["W"]))
    if passes["F"] is None or passes["B"] is None:
        raise ValueError(f"{path}: needs 'F' and either 'B' or both 'I' and 'W'")
    return UnitTimes(**passes)


def model_args(config: SimConfig) -> ModelShape | TransformerModelArgs:
    """The shape of ``config.flavor`` (:func:`~torchtitan_seq.simulate.flavors.flavor_shape`)."""
    if (shape := flavor_shape(config.flavor)) is None:
        raise ValueError(f"unknown flavor {config.flavor!r}: use one of {sorted(flavor_shapes)}, or FAMILY:FLAVOR")
    return shape


def _model_cost(config: SimConfig) -> UnitCost:
    return UnitCost.from_model_args(model_args(config), config.document_length or None)


def seconds_per_time_unit(config: SimConfig) -> float:
    """Seconds of one unit of ``config``'s times: for 'uniform' and 'transformer', one
    microbatch's forward on 1/p of the flavor's layers at ``config.network``'s FLOP/s;
    1 for a cost file in seconds."""
    if config.cost in ("uniform", "transformer"):
        return config.network.seconds_per_time_unit(model_args(config), _model_cost(config), config.seq_len, config.pp)
    if json.loads(Path(config.cost).read_text()).get("unit") != "s":
        raise ValueError(
            f"--cost {config.cost}: links that cost time need the file's times in seconds, "
            'marked "unit": "s" (bench.py --calibrate writes it)'
        )
    return 1.0


def job_shape(config: SimConfig) -> JobShape:
    """``config``'s :class:`~torchtitan_seq.runtime.shape.JobShape`: its cut as the runtime makes it (TP from
    ``config.network``); torch's schedules run whole sequences."""
    cost = _model_cost(config) if config.partition != "even" else None
    return JobShape(
        config.seq_len,
        config.subsequences,
        config.partition,
        cost,
        config.length_multiple,
        config.network.tensor_parallel,
        config.microbatches,
        config.stages_per_rank,
        whole=config.schedule not in SEQUENCE_SCHEDULES,
        cp=config.network.context_parallel,
    )


def subsequence_lengths(config: SimConfig) -> list[int]:
    """Lengths of ``config``'s k subsequences under its partition (:func:`job_shape`)."""
    return job_shape(config).lengths


def stage_times(
    kinds: frozenset,
    stage_to_rank: dict[int, int],
    chain_length: int,
    share: float,
    times: UnitTimes,
    chunk_times: ChunkTimes | None,
    schedule: str,
    cost: str,
) -> dict[int, dict[Any, tuple[float, ...] | None]]:
    """Per stage and pass kind, the time of each subsequence's unit: each stage's own chunk where
    ``chunk_times`` measured it on the stage's rank, else ``times`` (for a stage with 1/p of the
    layers) scaled by ``share``. Refuses a cost without times for one of the ``kinds`` of pass the lists run."""
    scaled = {
        kind: None if ts is None else tuple(t * share for t in ts)
        for kind, ts in ((F, times.F), (B, times.B), (I, times.I), (W, times.W))
    }
    missing = sorted(kind.value for kind in kinds if scaled[kind] is None)
    if missing:
        raise ValueError(f"{schedule} runs {missing} passes, but the cost {cost!r} has no times for them")
    own = {s: (chunk_times or {}).get((r, s % chain_length, chain_length)) for s, r in stage_to_rank.items()}
    if None not in own.values():
        return {s: {F: t.F, B: t.B, I: t.I, W: t.W} for s, t in own.items()}
    return dict.fromkeys(stage_to_rank, scaled)
