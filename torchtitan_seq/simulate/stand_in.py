"""torch's lowering on stand-in stages: the simulator lowers a schedule's compute-only lists with the
passes of the installed torch (``_PipelineScheduleRuntime._prepare_schedule_with_comms``, 2.15's send
waits included), run on stages without module or process group, as torch's own tests build them."""

from __future__ import annotations

from torchtitan_seq.runtime.torch_internals import Action, ModulelessStage, UnitScheduleRuntime

__all__ = ["MockStage", "torch_lowering"]


class MockStage(ModulelessStage):
    """A stage without module or process group, enough for torch's schedule constructors and
    lowering (the trick of torch's test_schedule.py MockPipelineStage)."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int = 0) -> None:
        self.submod = None
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.group = None


def torch_lowering(
    order: dict[int, list[Action | None]], num_stages: int, num_units: int
) -> tuple[dict[int, list[Action]] | None, dict[int, int]]:
    """torch's own lowering of compute-only lists (``_prepare_schedule_with_comms``, the passes of the
    installed torch), run on stand-in stages: (the lists the runtime runs, stage -> rank). The lists
    are None where torch finds no order for the sends and receives (a deadlock)."""
    held = sorted({a.stage_index for a in order[0] if a is not None}) or [0]
    runtime = UnitScheduleRuntime([MockStage(s, num_stages, len(order)) for s in held], num_units)
    try:
        runtime.lower(order)
    except AssertionError as e:
        if "can't schedule sends/recvs" not in str(e):
            raise
        return None, dict(runtime.stage_index_to_group_rank)
    return runtime.pipeline_order_with_comms, dict(runtime.stage_index_to_group_rank)
