"""MLA's latent in the planner: proposed (``kv_context = "latent"``) for an MLA model where a configuration fits
only with it, its step priced with the prefix expansion's FLOPs, which the FLOP counter measures; never for a
model without MLA, under ``--no-latent``, or where the configuration fits keeping K/V."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from torchtitan_seq.plan import search
from torchtitan_seq.plan.bounds import Candidate
from torchtitan_seq.plan.choices import ScheduleChoice
from torchtitan_seq.plan.cli import main
from torchtitan_seq.plan.flops import latent_flops
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.plan.measure import evaluate
from torchtitan_seq.plan.memory_check import KVOption, MemoryCheck, kv_options, memory
from torchtitan_seq.plan.search import plan
from torchtitan_seq.simulate.memory import gib

CHOICE = ScheduleChoice("Seq1F1B", 4, "compute")
JOB = Job("deepseek_v3:debugmodel", 16384, 4, tp=1, cp=1)
PP, GPUS = 2, 2


def _need(kv_context: str) -> float:
    return gib(memory(JOB, Cluster(GPUS, 80), CHOICE, PP, 1, "full", 1, KVOption(kv_context)).total)


def test_the_latent_is_an_option_for_mla_models_only():
    assert kv_options(JOB, CHOICE, 1) == [KVOption("reach"), KVOption("latent")]
    assert kv_options(replace(JOB, kv_offload=True), CHOICE, 1) == [
        KVOption("reach"),
        KVOption("reach", True),
        KVOption("latent"),
        KVOption("latent", True),
    ]
    for job, choice, cp in [
        (replace(JOB, latent=False), CHOICE, 1),  # --no-latent
        (replace(JOB, kv_context="full"), CHOICE, 1),  # asked for: kept
        (replace(JOB, flavor="debugmodel"), CHOICE, 1),  # Llama 3: no latent
        (JOB, ScheduleChoice("Seq1F1B", 1, "even"), 1),  # one unit: no prefix
        (JOB, ScheduleChoice("1F1B", 1, "even"), 1),
        (JOB, CHOICE, 2),  # CP
    ]:
        assert kv_options(job, choice, cp) == [KVOption(job.kv_context)], (job, choice, cp)


def test_the_memory_check_keeps_the_latent_only_where_it_fits_only_with_it():
    low, high = _need("latent"), _need("reach")
    assert low < 0.8 * high  # the K/V context is most of what a rank holds at 16K tokens
    c = Candidate(CHOICE, PP, 1, GPUS // PP, "full", math.inf, 1)
    for budget, job, need, kv_context in [
        (high + 1, JOB, high, "reach"),  # fits keeping K/V
        ((low + high) / 2, JOB, low, "latent"),  # fits only with the latent
        ((low + high) / 2, replace(JOB, latent=False), None, "reach"),
        (low - 0.01, JOB, None, "reach"),
    ]:
        check = MemoryCheck(job, Cluster(GPUS, budget), {PP: [(1, 1, GPUS // PP)]})
        assert check.need(c) == (pytest.approx(need) if need is not None else None)
        assert check.option(c).kv_context == kv_context


def test_the_planner_proposes_the_latent_where_a_configuration_fits_only_with_it(monkeypatch, capsys):
    monkeypatch.setattr(search, "CHOICES", [CHOICE])
    low, high = _need("latent"), _need("reach")
    latent = plan(JOB, Cluster(GPUS, (low + high) / 2), top=1, processes=1)[0]
    kept = plan(JOB, Cluster(GPUS, 1e9), top=1, processes=1)[0]  # every configuration fits keeping K/V
    assert latent.fits and latent.kv_context == "latent" and kept.kv_context == "reach"
    assert latent.tokens_per_s < kept.tokens_per_s
    # the same configuration, with and without the latent: the expansion is priced
    with_latent, keeping = (evaluate(JOB, Cluster(GPUS, b), CHOICE, PP, 1, "full") for b in ((low + high) / 2, 1e9))
    assert (with_latent.kv_context, keeping.kv_context) == ("latent", "reach")
    assert with_latent.tokens_per_s < 0.99 * keeping.tokens_per_s
    overrides = latent.overrides(JOB.flavor, JOB.seq_len, JOB.local_batch_size).split(" ")
    assert overrides[overrides.index("--sequence_pipeline.kv_context") + 1] == "latent"
    args = ["--flavor", JOB.flavor, "--seq-len", str(JOB.seq_len), "--gpus", str(GPUS), "--local-batch-size", "4"]
    args += ["--tp", "1", "--cp", "1", "--gpu-memory-gib", f"{(low + high) / 2}", "--top", "1", "--processes", "1"]
    assert main(args) == 0
    assert "Seq1F1B +latent" in capsys.readouterr().out
    assert main([*args, "--no-latent"]) == 2  # nothing fits keeping K/V
    assert "nothing fits" in capsys.readouterr().err


def test_the_priced_expansion_is_what_the_flop_counter_measures():
    """The cost model's expansion FLOPs (forward, backward's re-expansion and its two gradients) against
    torch's FLOP counter over one MLA layer's prefix expansion and its backward, unit by unit."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from torchtitan_seq.attention.latent import expand
    from torchtitan_seq.simulate.flavors import flavor_shape

    args = flavor_shape("deepseek_v3:debugmodel")
    mla, heads, lengths = args.mla, args.n_heads, [48, 32, 24, 16]
    up = torch.randn(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, requires_grad=True)
    counter = FlopCounterMode(display=False)
    with counter:
        for offset in [sum(lengths[:j]) for j in range(1, len(lengths))]:
            latent = torch.randn(1, offset, mla.kv_lora_rank, requires_grad=True)
            rope = torch.randn(1, offset, mla.qk_rope_head_dim)
            for _ in range(2):  # the forward's expansion, and the backward's again
                k, v = expand(latent, rope, up, mla.qk_nope_head_dim, heads)
            (k.sum() + v.sum()).backward()  # its input and weight gradients
    assert counter.get_total_flops() == latent_flops(mla, heads, lengths, 0.0)
    assert latent_flops(mla, heads, lengths, 1.0) == 5 / 4 * latent_flops(mla, heads, lengths, 0.0)
