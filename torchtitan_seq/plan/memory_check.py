"""Whether a configuration fits: the memory model's estimate of it (:func:`memory`), and the
search's check of its candidates, which asks the memory model as little as the answer needs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torchtitan_seq.plan.bounds import Candidate, cut_lengths
from torchtitan_seq.plan.choices import ScheduleChoice
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.runtime.reach import KVContextMode
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.memory import ACMode, MemoryConfig, MemoryEstimate, gib, memory_floor, predict_memory


@dataclass(frozen=True)
class KVOption:
    """What a configuration's K/V context keeps (``sequence_pipeline.kv_context``) and whether it goes to host
    memory while unread (``kv_offload``)."""

    kv_context: KVContextMode
    offload: bool = False


def memory_config(
    job: Job,
    cluster: Cluster,
    choice: ScheduleChoice,
    pp: int,
    tp: int,
    ac: ACMode,
    cp: int,
    option: KVOption | None = None,
) -> MemoryConfig:
    """The memory model's config of ``choice`` on a (pp, tp, cp, rest data-parallel) split, under the K/V
    settings ``option`` (None: the job's, without offload)."""
    option = option or KVOption(job.kv_context)
    return MemoryConfig(
        job.flavor,
        job.shape(choice, tp, cp),
        choice.schedule,
        pp,
        dp_shard=cluster.gpus // (pp * tp * cp),
        activation_checkpoint=ac,
        device=cluster.device,
        kv_context=option.kv_context,
        kv_offload=option.offload,
    )


def may_offload(job: Job, choice: ScheduleChoice) -> bool:
    """Whether the search may propose ``kv_offload`` for ``choice`` (a sequence schedule of more than one unit)."""
    return job.kv_offload and choice.schedule in SEQUENCE_SCHEDULES and choice.num_subsequences > 1


def may_keep_latent(job: Job, choice: ScheduleChoice, cp: int) -> bool:
    """Whether the search may propose ``kv_context = "latent"`` for ``choice``: an MLA model under the default
    ``"reach"`` (which keeps an MLA layer's whole K/V) where the job lets it, a sequence schedule of more than one
    unit, without CP."""
    return (
        job.latent
        and job.kv_context == "reach"
        and flavor_shape(job.flavor).mla is not None
        and choice.schedule in SEQUENCE_SCHEDULES
        and choice.num_subsequences > 1
        and cp == 1
    )


def kv_options(job: Job, choice: ScheduleChoice, cp: int) -> list[KVOption]:
    """The K/V settings the search may propose for ``choice``, in the order it prefers them, the least memory
    last: the job's own; ``kv_offload`` (:func:`may_offload`: the user asked for it, its copies overlap
    compute); MLA's latent (:func:`may_keep_latent`: its prefix expansion costs FLOPs); both."""
    options = [KVOption(job.kv_context)]
    if may_offload(job, choice):
        options.append(KVOption(job.kv_context, True))
    if may_keep_latent(job, choice, cp):
        options += [KVOption("latent", o.offload) for o in options]
    return options


def memory(
    job: Job,
    cluster: Cluster,
    choice: ScheduleChoice,
    pp: int,
    tp: int,
    ac: ACMode,
    cp: int = 1,
    option: KVOption | None = None,
) -> MemoryEstimate:
    """The memory model's estimate for ``choice`` on a (pp, tp, cp, rest data-parallel) split, under ``option``
    (None: the job's K/V settings, without offload)."""
    return predict_memory(memory_config(job, cluster, choice, pp, tp, ac, cp, option))


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

    Floors and needs are those of the candidate's lightest K/V option (:func:`kv_options`: with ``kv_offload``
    where the job lets it, MLA's latent where it may); a candidate that fits is then estimated under the
    options the search prefers, in order, and proposed with the first that fits (:meth:`option`)."""

    def __init__(self, job: Job, cluster: Cluster, by_pp: dict[int, list[tuple[int, int, int]]]) -> None:
        self.job, self.cluster, self.by_pp = job, cluster, by_pp
        self.met: list[Miss] = []
        """Misses in the order met; a group's lightest at the group's first candidate."""
        self.lightest: dict[Group, tuple[Candidate, float | None]] = {}
        """Per group met, its lightest and its need: None until estimated, inf where its floor is over."""
        self._options: dict[Candidate, KVOption] = {}

    def _config(self, c: Candidate, option: KVOption | None = None) -> MemoryConfig:
        option = option or kv_options(self.job, c.choice, c.cp)[-1]
        return memory_config(self.job, self.cluster, c.choice, c.pp, c.tp, c.ac, c.cp, option)

    def option(self, c: Candidate) -> KVOption:
        """The K/V settings with which ``c``, found to fit by :meth:`need` in this process, is proposed."""
        return self._options.get(c) or KVOption(self.job.kv_context)

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
        *preferred, lightest = kv_options(self.job, c.choice, c.cp)
        for option in preferred:
            if (lighter := gib(predict_memory(self._config(c, option)).total)) <= budget:
                self._options[c] = option
                return lighter
        self._options[c] = lightest
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
        the lightest K/V option, :func:`kv_options`)."""
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
