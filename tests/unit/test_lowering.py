"""The simulator runs the lists the runtime runs, on the installed torch: torch's own lowering for a
schedule of one chain (whatever passes that torch has: 2.15's send waits), the schedule's own for two
chains, with torch's waits added and checked as torch checks its own."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from torchtitan_seq import simulate as sim
from torchtitan_seq.runtime import torch_internals
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.build import stages_by_rank

ONE_CHAIN = [n for n, cls in SEQUENCE_SCHEDULES.items() if cls.stage_placement != "bidirectional"]
TWO_CHAINS = [n for n, cls in SEQUENCE_SCHEDULES.items() if cls.stage_placement == "bidirectional"]
SEND_KINDS = ("SEND_F", "SEND_B")


def _kinds(lowered) -> dict[str, int]:
    counts: dict[str, int] = {}
    for acts in lowered.values():
        for a in acts:
            counts[a.computation_type.name] = counts.get(a.computation_type.name, 0) + 1
    return counts


@pytest.mark.parametrize("name", ONE_CHAIN)
@pytest.mark.parametrize("pp,n,k", [(2, 2, 3), (4, 4, 2), (3, 5, 4)])
def test_one_chain_lowering_is_the_runtimes(name, pp, n, k):
    """The simulator's lowered lists equal those torch's runtime builds from the same compute-only
    lists on rank 0's stages (as a SequenceSchedule lowers them)."""
    r = sim.simulate(sim.SimConfig(name, pp, n, k))
    assert r.deadlock is None
    v = r.stages_per_rank
    held = stages_by_rank(name, pp)[0]
    runtime = _PipelineScheduleRuntime([sim.MockStage(s, pp * v, pp) for s in held], n * k)
    runtime._prepare_schedule_with_comms({rank: list(acts) for rank, acts in r.compute_order.items()})
    assert runtime.pipeline_order_with_comms == r.lowered


@pytest.mark.parametrize("name", TWO_CHAINS)
@pytest.mark.parametrize("pp,n,k", [(2, 2, 2), (4, 4, 3)])
def test_two_chain_lowering_waits_for_every_send(name, pp, n, k):
    """Where torch waits for sends (2.15), each send of a two-chain schedule has its wait, placed as
    torch's own check wants; before 2.15 there are none."""
    r = sim.simulate(sim.SimConfig(name, pp, n, k))
    assert r.deadlock is None
    kinds = _kinds(r.lowered)
    sends = sum(kinds.get(kind, 0) for kind in SEND_KINDS)
    waits = sum(kinds.get(f"WAIT_{kind}", 0) for kind in SEND_KINDS)
    assert sends > 0
    assert waits == (sends if torch_internals.WAIT_SEND else 0)
    if torch_internals.WAIT_SEND:
        from torch.distributed.pipelining.schedules import _validate_send_waits

        _validate_send_waits(r.lowered)
