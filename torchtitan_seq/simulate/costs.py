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
  Other keys (metadata) are ignored. Times are in any one unit (seconds, ms).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..partition import UnitCost, partition_sequence
from .build import SimConfig

__all__ = ["UnitTimes", "unit_times", "subsequence_lengths"]


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


def unit_times(config: SimConfig, lengths: list[int]) -> UnitTimes:
    """Per-unit times of ``config.cost`` for subsequences ``lengths`` (see the module docstring)."""
    total = sum(lengths)
    if config.cost == "uniform":
        fwd = tuple(length / total for length in lengths)
        return UnitTimes(F=fwd, B=tuple(2 * t for t in fwd), I=fwd, W=fwd)
    if config.cost == "transformer":
        cost = _model_cost(config)
        norm = cost.forward(total, 0)
        prefixes = [sum(lengths[:j]) for j in range(len(lengths))]

        def per_unit(pass_cost: Callable[[float, float], float]) -> tuple[float, ...]:
            return tuple(pass_cost(length, p) / norm for length, p in zip(lengths, prefixes))

        inp, wgt = per_unit(cost.backward_input), per_unit(cost.backward_weight)
        return UnitTimes(F=per_unit(cost.forward), B=tuple(i + w for i, w in zip(inp, wgt)), I=inp, W=wgt)
    return _load_times(Path(config.cost), len(lengths))


def _load_times(path: Path, k: int) -> UnitTimes:
    if not path.is_file():
        raise ValueError(f"--cost {path}: not 'uniform', 'transformer' or an existing JSON file")
    data = json.loads(path.read_text())
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


def _model_cost(config: SimConfig) -> UnitCost:
    # Imported here: the model pulls in torchtitan, which uniform costs never need.
    from ..models.llama3_seq import seq_llama3_flavors

    if config.flavor not in seq_llama3_flavors:
        raise ValueError(f"unknown flavor {config.flavor!r}: use one of {sorted(seq_llama3_flavors)}")
    return UnitCost.from_model_args(seq_llama3_flavors[config.flavor], config.document_length or None)


def subsequence_lengths(config: SimConfig) -> list[int]:
    """Lengths of ``config``'s k subsequences under its partition."""
    cost = _model_cost(config) if config.partition != "even" else None
    return partition_sequence(config.seq_len, config.subsequences, config.partition, cost=cost)
