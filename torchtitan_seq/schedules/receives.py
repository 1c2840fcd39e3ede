"""Receive buffers of a unit's length: torch describes (and before 2.15 allocates) every receive of a
stage like unit 0's, and units differ in length, so a stage resizes each unit's receives after torch
prepares them (:meth:`~torchtitan_seq.schedules.stage.SequencePipelineStage.resize_receives`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from torchtitan_seq.runtime.torch_internals import RecvInfo

__all__ = ["scale_receives"]


def scale_receives(receives_by_unit: dict, unit_length: Callable[[int], int], device: torch.device) -> None:
    """Resize the receives of each unit (unit id -> its receives' descriptions), described (and before
    torch 2.15 allocated) for unit 0, to the unit's length (``unit_length``), buffers on ``device``;
    shapes scale, so a tensor whose sequence is sharded (TP's sequence parallel) keeps its fraction.
    torch 2.13 adds metadata beside the buffer, which 2.15 allocates from just before each receive;
    torch 2.11 has no metadata and describes model inputs by placeholders."""
    first = unit_length(0)
    for unit_id, infos in receives_by_unit.items():
        length = unit_length(unit_id)

        def scaled(shape: torch.Size, length: int = length) -> torch.Size:
            return torch.Size([shape[0], shape[1] * length // first, *shape[2:]])

        for info in infos:
            if not isinstance(info, RecvInfo) or getattr(info, "is_root_arg", False):
                continue  # a model input: nothing is received
            if hasattr(info, "tensor_meta"):  # torch 2.13
                if info.tensor_meta is None:
                    continue
                changes = {}
                for prefix in ("", "global_"):
                    if shape := getattr(info.tensor_meta, f"{prefix}shape", None):
                        changes[f"{prefix}shape"] = shape = scaled(shape)
                        changes[f"{prefix}stride"] = torch.empty(shape, device="meta").stride()
                info.tensor_meta = meta = dataclasses.replace(info.tensor_meta, **changes)
                shape, dtype = meta.shape, meta.dtype
            else:
                shape, dtype = scaled(info.buffer.shape), info.buffer.dtype
            if info.buffer is not None:  # allocated now (before 2.15), not from the metadata at the receive
                grad = info.buffer.requires_grad
                info.buffer = torch.empty(shape, dtype=dtype, device=device, requires_grad=grad)
