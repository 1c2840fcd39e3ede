"""Whether a configuration fits: the memory model's estimate of it (:func:`memory`), and the
search's check of its candidates, which asks the memory model as little as the answer needs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torchtitan_seq.plan.bounds import Candidate, cut_lengths
from torchtitan_seq.plan.choices import ScheduleChoice
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.memory import ACMode, MemoryConfig, MemoryEstimate, gib, memory_floor, predict_memory


def memory_config(
    job: Job, cluster: Cluster, choice: ScheduleChoice, pp: int, tp: int, ac: ACMode, cp: int, offload: bool = False
) -> MemoryConfig:
    return MemoryConfig(
        job.flavor,
        job.shape(choice, tp, cp),
        choice.schedule,
        pp,
        dp_shard=cluster.gpus // (pp * tp * cp),
        activation_checkpoint=ac,
        device=cluster.device,
        kv_context=job.kv_context,
        kv_offload=offload,
    )


def may_offload(job: Job, choice: ScheduleChoice) -> bool:
    """Whether the search may propose ``kv_offload`` for ``choice`` (a sequence schedule of more than one unit)."""
    return job.kv_offload and choice.schedule in SEQUENCE_SCHEDULES and choice.num_subsequences > 1


def memory(
    job: Job, cluster: Cluster, choice: ScheduleChoice, pp: int, tp: int, ac: ACMode, cp: int = 1, offload: bool = False
) -> MemoryEstimate:
    """The memory model's estimate for ``choice`` on a (pp, tp, cp, rest data-parallel) split (``offload``:
    with ``kv_offload``)."""
    return predict_memory(memory_config(job, cluster, choice, pp, tp, ac, cp, offload))


Group = tuple[ScheduleChoice, int, int]
"""(choice, pp, cp): candidates that differ only in TP and AC."""


@dataclass
class Miss:
    """A configuration met that does not fit: ``gib`` its estimate's need, or a floor of it."""

    gib: float
    exact: bool
    candidate: Candidate
    group: Group | None = None
    """A candidate's group: the miss counts only where the group's lightest fits (else the search
    skips the candidate and counts the lightest); None: a lightest."""


class MemoryCheck:
    """Whether the search's candidates fit, asking the memory model as little as the answer needs.

    A group's lightest candidate (most TP, full AC) is taken to need the least: where it does not
    fit, no candidate of the group is kept, and the lightest, not the candidate, counts as met
    (:meth:`closest`). Every need is first weighed against the memory model's floor
    (:func:`~torchtitan_seq.simulate.memory.memory_floor`), which most candidates exceed by far,
    and the estimate taken only where the floor fits; a group's lightest is estimated only once a
    candidate of it fits (what the first visit would have met is worked out in :meth:`closest`).

    Where the job lets it (:func:`may_offload`), floors and needs are those with ``kv_offload``, the least; a
    candidate that fits is then estimated without it, and needs it (:meth:`offloads`) only where that does
    not fit."""

    def __init__(self, job: Job, cluster: Cluster, by_pp: dict[int, list[tuple[int, int, int]]]) -> None:
        self.job, self.cluster, self.by_pp = job, cluster, by_pp
        self.met: list[Miss] = []
        """Misses in the order met; a group's lightest at the group's first candidate."""
        self.lightest: dict[Group, tuple[Candidate, float | None]] = {}
        """Per group met, its lightest and its need: None until estimated, inf where its floor is over."""
        self._offloading: set[Candidate] = set()

    def _config(self, c: Candidate, offload: bool | None = None) -> MemoryConfig:
        offload = may_offload(self.job, c.choice) if offload is None else offload
        return memory_config(self.job, self.cluster, c.choice, c.pp, c.tp, c.ac, c.cp, offload)

    def offloads(self, c: Candidate) -> bool:
        """Whether ``c``, found to fit by :meth:`need` in this process, fits only with ``kv_offload``."""
        return c in self._offloading

    def _estimate(self, c: Candidate) -> float:
        return gib(predict_memory(self._config(c)).total)

    def need(self, c: Candidate) -> float | None:
        """The GiB per GPU ``c`` needs where it and its group's lightest fit the budget, else None."""
        budget, group = self.cluster.gpu_memory_gib, (c.choice, c.pp, c.cp)
        if group not in self.lightest:
            tp, dp = [
                (t, d)
                for t, q, d in self.by_pp[c.pp]
                if q == c.cp and cut_lengths(self.job, c.choice, t, q) is not None
            ][-1]
            light = replace(c, tp=tp, dp=dp, ac="full")
            floor = gib(memory_floor(self._config(light)))
            self.lightest[group] = light, (math.inf if floor > budget else None)
            self.met.append(Miss(floor, False, light))
        light, light_need = self.lightest[group]
        if light_need == math.inf:
            return None
        config = self._config(c)
        floor = gib(memory_floor(config))
        if floor <= budget:
            floor = gib(memory_floor(config, walked=True))
        if floor > budget:
            self.met.append(Miss(floor, False, c, group))
            return None
        if (need := self._estimate(c)) > budget:
            self.met.append(Miss(need, True, c, group))
            return None
        if light_need is None:
            light_need = self._lightest_need(group)
        if light_need > budget:
            return None
        if may_offload(self.job, c.choice):
            if (plain := gib(predict_memory(self._config(c, offload=False)).total)) <= budget:
                return plain
            self._offloading.add(c)
        return need

    def _lightest_need(self, group: Group) -> float:
        light, need = self.lightest[group]
        if need is None or need == math.inf:
            need = self._estimate(light)
            self.lightest[group] = light, need
        return need

    def closest(self) -> list[tuple[float, Candidate]]:
        """The three configurations met closest to fitting, with their needs (ties: the first met first):
        misses in ascending order of need or floor, estimated while one may still beat the third (with
        ``kv_offload`` where :func:`may_offload`)."""
        budget, best = self.cluster.gpu_memory_gib, []
        for low, i in sorted((miss.gib, i) for i, miss in enumerate(self.met)):
            if len(best) == 3 and low > best[-1][0]:
                break
            miss = self.met[i]
            if miss.group is None:  # a lightest: met where it does not fit
                need = self._lightest_need((miss.candidate.choice, miss.candidate.pp, miss.candidate.cp))
            elif self._lightest_need(miss.group) > budget:
                continue  # the search skipped the candidate: its lightest does not fit
            else:
                need = miss.gib if miss.exact else self._estimate(miss.candidate)
            if need > budget:
                best = sorted([*best, (need, i, miss.candidate)], key=lambda x: x[:2])[:3]
        return [(need, c) for need, _, c in best]
