"""Cost models of the simulator: how long each pass of each unit takes, and unit lengths.

Time is measured in forwards of one whole microbatch on a stage holding 1/p of
the layers (:mod:`.engine` scales to 1/V of a rank's layers, V stages per
rank). Unit j of length L_j after a prefix P_j costs:

- ``uniform``: F = L_j / S, B = 2 F, I = W = F (S the sequence length);
- ``transformer``: :class:`~torchtitan_seq.partition.UnitCost` of the model
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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..flavors import ModelShape, flavor_shape, flavor_shapes
from ..partition import UnitCost, partition_sequence
from .build import SimConfig

if TYPE_CHECKING:
    from torchtitan.models.llama3 import TransformerModelArgs

__all__ = [
    "UnitTimes", "ChunkTimes", "unit_times", "unit_and_chunk_times", "transformer_times", "subsequence_lengths", "model_args",
    "seconds_per_time_unit",
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
    return _recomputing(times, recompute), {key: _recomputing(t, recompute) for key, t in chunks.items()}


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
    """The shape of ``config.flavor`` (:func:`~torchtitan_seq.flavors.flavor_shape`)."""
    if (shape := flavor_shape(config.flavor)) is None:
        raise ValueError(f"unknown flavor {config.flavor!r}: use one of {sorted(flavor_shapes)}")
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


def subsequence_lengths(config: SimConfig) -> list[int]:
    """Lengths of ``config``'s k subsequences under its partition."""
    cost = _model_cost(config) if config.partition != "even" else None
    return partition_sequence(config.seq_len, config.subsequences, config.partition, cost=cost)
