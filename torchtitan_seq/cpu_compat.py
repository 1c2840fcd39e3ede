"""CPU compatibility for torchtitan 0.2.2, applied before torchtitan is imported.

torchtitan 0.2.2 assumes an accelerator. Without CUDA this module makes it run
on the CPU with gloo, and does nothing at all when CUDA is present:

* device detection falls back to "cpu" (torchtitan falls back to "cuda");
* ``torch.cpu`` gains the memory API torchtitan's memory monitor calls, with
  the process's peak resident set size as the peak memory;
* ``barrier(device_ids=["cpu"])`` drops the device ids gloo rejects;
* ``torch.profiler.profile`` ignores the ``None`` that torchtitan's profiler
  lists as its activity when there is no GPU, so ``[profiling]`` works;
* FSDP2 reduces gradients with plain sums (:func:`fsdp_for_gloo`), since gloo
  has no PREMUL_SUM.

Attention needs nothing here: the sequence model and torchtitan's Llama 3
debug flavors use SDPA, which has a CPU backward. torch's and torchtitan's
files stay unmodified on disk.
"""

from __future__ import annotations

import functools
import os
import resource
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["apply", "fsdp_for_gloo", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_memory_stats(*_args, **_kwargs) -> dict[str, int]:
    peak = peak_rss_bytes()
    return {
        "active_bytes.all.peak": peak,
        "reserved_bytes.all.peak": peak,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def _cpu_device_properties(*_args, **_kwargs) -> types.SimpleNamespace:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(name="cpu", total_memory=total)


def _barrier_without_cpu_ids(barrier):
    @functools.wraps(barrier)
    def wrapped(group=None, async_op=False, device_ids=None):
        if device_ids is not None and not all(isinstance(d, int) for d in device_ids):
            device_ids = None
        return barrier(group=group, async_op=async_op, device_ids=device_ids)

    wrapped.__torchtitan_seq_cpu__ = True
    return wrapped


def _profile_without_missing_device(init):
    @functools.wraps(init)
    def wrapped(self, *args, activities=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a is not None]
        init(self, *args, activities=activities, **kwargs)

    wrapped.__torchtitan_seq_cpu__ = True
    return wrapped


def apply() -> bool:
    """Patch what torchtitan needs on a machine without CUDA; returns whether it did.

    Idempotent. Must run before the first torchtitan import, because
    torchtitan reads the device type at import time.
    """
    if torch.cuda.is_available():
        return False
    detect = torch._utils._get_available_device_type
    if not getattr(detect, "__torchtitan_seq_cpu__", False):
        cpu_fallback = lambda: detect() or "cpu"  # noqa: E731
        cpu_fallback.__torchtitan_seq_cpu__ = True
        torch._utils._get_available_device_type = cpu_fallback
    cpu = torch.cpu
    for name, fn in {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": _cpu_device_properties,
        "memory_stats": _cpu_memory_stats,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
    }.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    if not getattr(dist.barrier, "__torchtitan_seq_cpu__", False):
        dist.barrier = _barrier_without_cpu_ids(dist.barrier)
    profile = torch.profiler.profile
    if not getattr(profile.__init__, "__torchtitan_seq_cpu__", False):
        profile.__init__ = _profile_without_missing_device(profile.__init__)
    return True


def fsdp_for_gloo(model_parts: list[nn.Module]) -> None:
    """Make FSDP2 modules reduce with SUM (then divide) instead of PREMUL_SUM, on the CPU."""
    if torch.cuda.is_available():
        return
    for part in model_parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
