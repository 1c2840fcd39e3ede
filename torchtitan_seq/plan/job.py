"""What a plan is made for: the job (a flavor, its sequence length and batch, fixed degrees,
calibration files) and the cluster (GPUs, their memory, FLOP/s and links, and the fixed cost of a
unit measured on an H200)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchtitan_seq.plan.choices import ScheduleChoice
from torchtitan_seq.runtime.reach import KVContextMode
from torchtitan_seq.runtime.shape import LENGTH_MULTIPLE, JobShape
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.memory import Device
from torchtitan_seq.simulate.network import Link

H200_UNIT_OVERHEAD_S = 1.393e-3
"""Seconds a unit's forward + backward costs per layer beyond its share of the FLOPs on an H200:
:func:`~torchtitan_seq.simulate.costs.gpu_fixed_cost_per_layer` of the newest GPU check's cuDNN cost
files, ``benchmarks/gpu/2026-12-04/cudnn`` (a 4-layer Llama 3 stack of dim 2048, 16 heads, 8 KV
heads, bf16, batch 1, units through the KV context; the whole sequence and every cut, k = 1, 2, 4, 8).
Of the fit's terms the fixed cost varies most from run to run (benchmarks/README.md gives the runs).
Taken as the GPU's and the code's, whatever the model's width: kernel launches, host work and the
per-call merges of unit attention do not shrink with a unit, and are not divided by TP.

Refit it when a GPU check commits new cost files (``benchmarks/gpu_check.sh --out
benchmarks/gpu/DATE/cudnn`` on an H200, whose default kernel is cuDNN, prints the fit), and name the
new folder here: a unit test holds this value to the fit of the newest folder."""


@dataclass(frozen=True)
class Cluster:
    """The GPUs a job may use."""

    gpus: int
    gpu_memory_gib: float
    gpus_per_node: int = 8
    flops_per_gpu: float = 400e12
    """Achieved FLOP/s per GPU (about 40% of an H100's dense bf16 peak)."""
    intra_node: Link = Link(200e9, 5e-6)
    """NVLink-class, per GPU and direction."""
    inter_node: Link = Link(25e9, 1e-5)
    """One 200 Gb/s NIC per GPU."""
    device: Device = "cuda"
    """What the memory model sizes (RMSNorm saves more on the CPU)."""
    unit_overhead_s: float = H200_UNIT_OVERHEAD_S
    """Fixed seconds per unit (forward + backward) and layer on top of the cost model's FLOPs."""
    host_link: Link = Link(50e9, 1e-5)
    """PCIe 5.0 x16-class, per GPU and direction: what ``kv_offload``'s copies to host memory cross."""


@dataclass(frozen=True)
class Job:
    """What is trained: a flavor at a sequence length, ``local_batch_size`` sequences per
    data-parallel rank and step, one sequence per microbatch."""

    flavor: str
    """The flavor as the tools name it: a Llama 3 flavor, or ``family:flavor``
    (:mod:`~torchtitan_seq.simulate.flavors`)."""
    seq_len: int
    local_batch_size: int
    tp: int | None = None
    """A fixed TP degree; None searches 1, 2, 4, 8 within a node."""
    costs: tuple[Path, ...] = ()
    """Calibration files (``bench.py --calibrate``) of this flavor and sequence length."""
    length_multiple: int = LENGTH_MULTIPLE
    """``sequence_pipeline.length_multiple``: every subsequence length a multiple of it and of tp."""
    cp: int | None = None
    """A fixed CP degree (sequence schedules); None searches 1, 2, 4, 8."""
    kv_context: KVContextMode = "reach"
    """``sequence_pipeline.kv_context``: exact either way, ``"reach"`` holds less K/V of layers of bounded
    reach (a sliding window, attention chunks)."""
    kv_offload: bool = False
    """Whether the planner may propose ``sequence_pipeline.kv_offload`` (exact either way) for a sequence
    schedule that fits only with it, its copies timed over ``Cluster.host_link`` (``--kv-offload``)."""
    latent: bool = True
    """Whether the planner may propose ``sequence_pipeline.kv_context = "latent"`` (exact either way) for an MLA
    model under ``kv_context = "reach"`` where a configuration fits only with it, its step priced with the
    prefix expansion's FLOPs (``--no-latent``: never)."""

    def shape(self, choice: ScheduleChoice, tp: int, cp: int = 1) -> JobShape:
        """The cut and microbatches of ``choice`` at TP ``tp`` and CP ``cp``, as the runtime derives them."""
        return JobShape.of_model(
            flavor_shape(self.flavor),
            self.seq_len,
            choice.num_subsequences,
            choice.partition,
            length_multiple=self.length_multiple,
            tp=tp,
            microbatches=self.local_batch_size,
            stages_per_rank=choice.stages_per_rank,
            whole=choice.schedule not in SEQUENCE_SCHEDULES,
            cp=cp,
        )
