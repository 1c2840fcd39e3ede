"""Per-action timing of a pipeline step: when each compute action ran on this rank.

Pipeline stages time every forward, backward, input- and weight-gradient pass
with :data:`RECORDER`, which keeps the latest schedule step's actions (with
gradient accumulation, the training step's last). The trainer enables it for
the steps that log (and so may export) a timeline and disables it after them;
while enabled an action costs two clock reads and an append: ``time.perf_counter``
on a CPU; on CUDA, timing events read when the step is summarised, so that a
time is when the work ran on the GPU, not when it was queued. Disabled, it
reads no clock and keeps nothing.

Times are ms since the rank's own step start: ranks start a step together (the
previous one ends in collectives), so a rank's idle time is the makespan, the latest
end over all ranks, less its busy time (:func:`~torchtitan_seq.instrumentation.render.bubble_ratios`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import I, W

from torchtitan_seq.instrumentation.render import Interval, Timeline, chrome_trace, timeline_figure
from torchtitan_seq.runtime.torch_internals import Action, ComputationType

if TYPE_CHECKING:
    from torchtitan.config import Profiling

__all__ = ["StepTimeline", "RECORDER", "measured_result", "export_due", "export_timeline"]

logger = logging.getLogger(__name__)

FREQ_ENV = "TORCHTITAN_SEQ_TIMELINE_FREQ"
"""Environment variable: export the timeline every N steps, profiler or not."""
TRACE_FILE = "pipeline_timeline.json"
"""Name of the Chrome trace in torchtitan's ``iteration_{step}`` profiling folder."""
FIGURE_TAG = "pipeline/timeline"


class StepTimeline:
    """Start and end of every compute action of the latest pipeline step on this process."""

    def __init__(self) -> None:
        self.enabled = False
        self._cuda = False
        self._origin: float | torch.cuda.Event | None = None  # the step start; None before the first
        # (start mark, end mark, action); marks are clock readings or CUDA events
        self._marks: list[tuple[object, object, Action]] = []

    def enable(self, device: torch.device) -> None:
        """Record from the next step on, timing work on ``device``."""
        self.enabled = True
        self._cuda = torch.device(device).type == "cuda"

    def disable(self) -> None:
        """Record nothing from the next step on."""
        self.enabled = False

    def _mark(self) -> float | torch.cuda.Event:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_step(self) -> None:
        """A schedule step begins (torch's ``clear_runtime_states``): forget the previous step's
        actions, so that a step not recorded reads as none rather than as an older one."""
        self._marks.clear()
        self._origin = self._mark() if self.enabled else None

    @contextlib.contextmanager
    def action(self, stage_index: int, kind: ComputationType, chunk_id: int) -> Iterator[None]:
        """Time one compute action (``kind``: F, B, I or W) of ``stage_index`` on unit
        (or microbatch) ``chunk_id``."""
        start = self._mark() if self.enabled else None
        yield
        if start is not None:
            self._marks.append((start, self._mark(), Action(stage_index, kind, chunk_id)))

    def intervals(self) -> list[Interval]:
        """(start ms, end ms, action) of the latest step, in run order; none where no timed step
        ran (torch's own stages never start one)."""
        if self._origin is None or not self._marks:
            return []
        if self._cuda:
            self._marks[-1][1].synchronize()
        ms = self._origin.elapsed_time if self._cuda else lambda mark: (mark - self._origin) * 1e3
        return [(ms(s), ms(e), a) for s, e, a in self._marks]


RECORDER = StepTimeline()
"""This process's recorder (one pipeline rank per process)."""


def measured_result(timelines: dict[int, list[Interval]], schedule: str, num_subsequences: int) -> Timeline:
    """The measured step as a :class:`Timeline`; its shape (microbatches, stages per rank, split
    backward) is read off the actions.

    Args:
        timelines: per rank, (start, end, action) of its compute actions, in ms since the step start.
        schedule: the schedule's name, for the title.
        num_subsequences: k (1 for torch's schedules).

    Returns:
        The step's timeline, in ms.
    """
    actions = [a for ivs in timelines.values() for _, _, a in ivs]
    units = 1 + max((a.microbatch_index for a in actions), default=-1)
    return Timeline(
        schedule=schedule,
        pp=len(timelines),
        microbatches=-(-units // num_subsequences),
        subsequences=num_subsequences,
        stages_per_rank=max(1, len({a.stage_index for a in actions}) // max(1, len(timelines))),
        split_backward=any(a.computation_type in (I, W) for a in actions),
        timeline=dict(timelines),
        compute_order={r: [a for _, _, a in timelines[r]] for r in sorted(timelines)},
    )


def export_due(step: int, profiling: Profiling) -> bool:
    """Whether ``step`` exports its timeline: a step torchtitan's profiler traces (``profiling``:
    the job's ``[profiling]`` section), or every N steps with ``TORCHTITAN_SEQ_TIMELINE_FREQ=N``
    (a timeline without the cost of torch's profiler)."""
    freq = int(os.environ.get(FREQ_ENV, "0"))
    traced = profiling.enable_profiling and step % profiling.profile_freq == 0
    return traced or (freq > 0 and step % freq == 0)


def export_timeline(step: int, schedule: str, num_subsequences: int, trace_dir: Path, writers: list) -> None:
    """Gather every rank's timeline of the latest step (a collective: every rank calls it); rank 0
    writes the Chrome trace ``trace_dir/iteration_{step}/pipeline_timeline.json``, and each
    TensorBoard ``SummaryWriter`` in ``writers`` gets the figure as ``pipeline/timeline``.

    Args:
        step: the training step, which names the trace's folder and the figure's step.
        schedule: the schedule's name, for the title.
        num_subsequences: k (1 for torch's schedules).
        trace_dir: torchtitan's profiling folder.
        writers: TensorBoard ``SummaryWriter``s (none: no figure, and matplotlib is not needed).
    """
    gathered = [local := RECORDER.intervals()]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    result = measured_result(dict(enumerate(gathered)), schedule, num_subsequences)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = trace_dir / f"iteration_{step}" / TRACE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(chrome_trace(result)))
    if not writers:
        return
    try:
        figure = timeline_figure(result)
    except ImportError:
        logger.warning("pipeline timeline image skipped: it needs matplotlib ('torchtitan_seq[bench]')")
        return
    for writer in writers:
        writer.add_figure(FIGURE_TAG, figure, step, close=False)
