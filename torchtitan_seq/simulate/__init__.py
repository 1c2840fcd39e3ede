"""Timing simulation of pipeline schedules, on the action lists the runtime executes.

* :mod:`.build`: :class:`SimConfig`, a schedule's per-rank compute-only lists, lowered as the runtime does;
* :mod:`.costs`: pass times per unit (uniform, transformer, or measured) and subsequence lengths;
* :mod:`.network`: communication: intra- and inter-node links (bandwidth, latency), the bytes a
  SEND carries, the end-of-step all-reduces of BSIPipe's and Chimera's parameter copies;
* :mod:`.engine`: the timing model and deadlock detection: :func:`simulate` returns a
  :class:`SimResult`, a :class:`torchtitan_seq.instrumentation.render.Timeline` plus the simulator's own fields;
* :mod:`.memory`: bytes per rank (parameters, gradients, optimizer, activations, KV context,
  workspace, receive buffers) by arithmetic on the built lists: :func:`~.memory.predict_memory`
  (imported from the submodule, not re-exported here: it looks flavors up in torchtitan);
* :mod:`.offload`: the K/V offload's copies on each rank's host link and the passes they delay
  (:func:`~.offload.offload_delays`, on a simulated step);
* :mod:`.regenerate`: the committed ``schedules/`` folder; :mod:`.cli`: the command line.

The writers (SVG, Chrome trace, CSV) are :mod:`torchtitan_seq.instrumentation.render`'s, shared with the
measured timelines of :mod:`torchtitan_seq.instrumentation.timeline`.

Usage::

    python -m torchtitan_seq.simulate --schedule Seq1F1B --pp 4 --microbatches 4 \\
        --subsequences 4 --svg seq1f1b.svg --json
    python -m torchtitan_seq.simulate --regenerate schedules
    python -m torchtitan_seq.simulate --schedule BSIPipe --pp 8 --microbatches 16 \\
        --subsequences 2 --cost transformer --flavor 8B --seq-len 8192 --gpus-per-node 4 \\
        --intra-node-bandwidth 200e9 --inter-node-bandwidth 25e9 --flops-per-gpu 150e12
"""

from torchtitan_seq.instrumentation.render import chrome_trace, compute_csv, render_svg
from torchtitan_seq.schedules import TORCH_SCHEDULES
from torchtitan_seq.simulate.build import SimConfig
from torchtitan_seq.simulate.cli import main
from torchtitan_seq.simulate.costs import UnitTimes, transformer_times, unit_times
from torchtitan_seq.simulate.engine import Deadlock, SimResult, StuckRank, simulate, simulate_order
from torchtitan_seq.simulate.network import Link, Network, Transfers
from torchtitan_seq.simulate.regenerate import regenerate, standard_configs
from torchtitan_seq.simulate.stand_in import MockStage

__all__ = [
    "TORCH_SCHEDULES",
    "SimConfig",
    "MockStage",
    "UnitTimes",
    "unit_times",
    "transformer_times",
    "Link",
    "Network",
    "Transfers",
    "Deadlock",
    "StuckRank",
    "SimResult",
    "simulate",
    "simulate_order",
    "regenerate",
    "standard_configs",
    "main",
    "render_svg",
    "chrome_trace",
    "compute_csv",  # torchtitan_seq.instrumentation.render's, for SimResults
]
