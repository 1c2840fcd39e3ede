"""CPU compatibility for torchtitan 0.2.2 and 0.3, applied before torchtitan is imported.

torchtitan assumes an accelerator (0.3 as 0.2.2: the same device detection, barriers and memory
API; 0.3's CUDA graphs are off in every shipped config function, as pipelines need). Without CUDA
this module makes it run on the CPU with gloo (with CUDA it does nothing); torch's and torchtitan's
files stay unmodified on disk:

* device detection falls back to "cpu" (torchtitan falls back to "cuda"), and so does
  ``create_block_mask``'s default device (it defaults to the accelerator, which the registry's CUDA
  builds of torch 2.14 and 2.15 report as ``cuda`` without a GPU);
* ``torch.cpu`` gains the memory API torchtitan's memory monitor calls, with the process's peak
  resident set size as the peak memory;
* ``barrier(device_ids=["cpu"])`` drops the device ids gloo rejects;
* ``torch.profiler.profile`` ignores the ``None`` that torchtitan's profiler lists as its activity
  when there is no GPU, so ``[profiling]`` works;
* FSDP2 reduces gradients with plain sums (:func:`fsdp_for_gloo`), since gloo has no PREMUL_SUM;
* ``torch.histc`` counts integers (an MoE router's expert indices, which torchtitan counts tokens per
  expert by) as floats, as its CUDA kernel takes them and its CPU kernel does not;
* under expert parallelism, torchtitan 0.2.2 orders the tokens each rank receives by expert with a
  Triton kernel; its own CPU implementation of the same indices (``use_cpu=True``) stands in
  (:func:`moe_permute_on_cpu`, applied once torchtitan is imported, by the version's registration).

Attention needs nothing: the models use SDPA, which has a CPU backward (under 0.3 too, whose Llama 3
flavors default to flex attention, with no CPU backward: torchtitan_seq's model replaces it).
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
from torch.nn.attention import flex_attention

from torchtitan_seq.runtime.torch_internals import DEVICE_TYPE_DETECTION

__all__ = ["apply", "fsdp_for_gloo", "moe_permute_on_cpu"]


def _cpu_memory_stats(*_args, **_kwargs) -> dict[str, int]:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}


def _cpu_device_properties(*_args, **_kwargs) -> types.SimpleNamespace:
    return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _barrier_without_cpu_ids(barrier):
    def wrapped(group=None, async_op=False, device_ids=None):
        if device_ids is not None and not all(isinstance(d, int) for d in device_ids):
            device_ids = None
        return barrier(group=group, async_op=async_op, device_ids=device_ids)

    return wrapped


def _profile_without_missing_device(init):
    def wrapped(self, *args, activities=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a is not None]
        init(self, *args, activities=activities, **kwargs)

    return wrapped


def _block_mask_on_cpu(create_block_mask):
    def wrapped(mask_mod, B, H, Q_LEN, KV_LEN, device=None, *args, **kwargs):
        return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device or "cpu", *args, **kwargs)

    return wrapped


def _histc_of_integers(histc):
    def wrapped(input, *args, **kwargs):
        if input.is_floating_point():
            return histc(input, *args, **kwargs)
        # exact: expert indices and counts are far below 2**24; the counts in the input's dtype, as CUDA's
        return histc(input.float(), *args, **kwargs).to(input.dtype)

    return wrapped


def _patch(owner: object, name: str, wrap) -> None:
    """Replace ``owner.name`` by ``wrap(owner.name)``, once: the mark keeps :func:`apply` idempotent."""
    original = getattr(owner, name)
    if not getattr(original, "__torchtitan_seq_cpu__", False):
        patched = functools.wraps(original)(wrap(original))
        patched.__torchtitan_seq_cpu__ = True
        setattr(owner, name, patched)


def apply() -> None:
    """Patch torch where torchtitan needs it on a machine without CUDA; with CUDA, do nothing.

    Idempotent. Run it before the first torchtitan import: torchtitan reads the device type at import
    time. The patches are the module docstring's list.
    """
    if torch.cuda.is_available():
        return
    _patch(*DEVICE_TYPE_DETECTION, lambda detect: lambda: detect() or "cpu")
    _patch(flex_attention, "create_block_mask", _block_mask_on_cpu)
    _patch(dist, "barrier", _barrier_without_cpu_ids)
    _patch(torch.profiler.profile, "__init__", _profile_without_missing_device)
    _patch(torch, "histc", _histc_of_integers)
    for name, fn in {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": _cpu_device_properties,
        "memory_stats": _cpu_memory_stats,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
    }.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def moe_permute_on_cpu(moe_utils: types.ModuleType) -> None:
    """Without CUDA, make torchtitan 0.2.2's expert-parallel token permutation
    (``torchtitan.models.moe.utils.generate_permute_indices``, a Triton kernel) take torchtitan's own CPU
    implementation of it; with CUDA leave it.

    Args:
        moe_utils: the module ``torchtitan.models.moe.utils``.
    """
    if not torch.cuda.is_available():
        _patch(moe_utils, "generate_permute_indices", lambda generate: functools.partial(generate, use_cpu=True))


def fsdp_for_gloo(model_parts: list[nn.Module]) -> None:
    """Make FSDP2 modules reduce gradients with SUM (then divide) instead of PREMUL_SUM, on the CPU.

    gloo has no PREMUL_SUM; with CUDA the modules are left as they are.

    Args:
        model_parts: the trainer's model parts; every :class:`FSDPModule` among their modules is set.
    """
    if not torch.cuda.is_available():
        for m in (m for part in model_parts for m in part.modules() if isinstance(m, FSDPModule)):
            m.set_force_sum_reduction_for_comms(True)
