"""Timing simulation of pipeline schedules, on the action lists the runtime executes.

* :mod:`.build`: :class:`SimConfig`, a schedule's per-rank compute-only lists, lowered as the runtime does;
* :mod:`.costs`: pass times per unit (uniform, transformer, or measured) and subsequence lengths;
* :mod:`.engine`: the timing model and deadlock detection: :func:`simulate` returns a
  :class:`SimResult`, a :class:`torchtitan_seq.render.Timeline` plus the simulator's own fields;
* :mod:`.regenerate`: the committed ``schedules/`` folder; :mod:`.cli`: the command line.

The writers (SVG, Chrome trace, CSV) are :mod:`torchtitan_seq.render`'s, shared with the
measured timelines of :mod:`torchtitan_seq.timeline`.

Usage::

    python -m torchtitan_seq.simulate --schedule Seq1F1B --pp 4 --microbatches 4 \\
        --subsequences 4 --svg seq1f1b.svg --json
    python -m torchtitan_seq.simulate --regenerate schedules
"""

from ..render import chrome_trace, compute_csv, render_svg
from ..schedules import TORCH_SCHEDULES
from .build import MockStage, SimConfig
from .cli import main
from .costs import UnitTimes, unit_times
from .engine import Deadlock, SimResult, StuckRank, simulate, simulate_order
from .regenerate import regenerate, standard_configs

__all__ = [
    "TORCH_SCHEDULES", "SimConfig", "MockStage", "UnitTimes", "unit_times", "Deadlock", "StuckRank", "SimResult",
    "simulate", "simulate_order", "regenerate", "standard_configs", "main",
    "render_svg", "chrome_trace", "compute_csv",  # torchtitan_seq.render's, for SimResults
]
