"""torch's private names, in one place.

Everything the package takes from torch that torch does not publish is reached through this module:
the pipelining IR and its lowering passes, the runtime's and the stage's hooks, receive buffers, the
attention ops behind SDPA, and three settings. Each entry of :data:`PRIVATE_NAMES` says why the
public API does not serve; ``tests/unit/test_torch_internals.py`` lists every private torch name the
package uses and fails on one used anywhere else. Where a release of torch changed a private name,
the difference is bridged here, by feature (``hasattr``, a signature), not by version number.

Checked against torch 2.11 (benchmarks/gpu_check.sh on the GPU machine), 2.13.0, 2.14.1 and 2.15.0.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.config
import torch._utils
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action, _ComputationType
from torch.distributed.pipelining.stage import _PipelineStageBase, _RecvInfo
from torch.utils._pytree import tree_map_only

__all__ = [
    "PRIVATE_NAMES",
    "Action",
    "ComputationType",
    "WAIT_SEND",
    "PRE_SPLIT_STEP",
    "UnitScheduleRuntime",
    "UnitStageBase",
    "MockStage",
    "torch_lowering",
    "add_send_waits",
    "add_unshard_reshard",
    "add_reduce_grad",
    "stage_to_rank_mapping",
    "detach_tensors",
    "allow_recompiles",
    "dispatch_mode_active",
    "function_apply",
    "DEVICE_TYPE_DETECTION",
    "SdpaOps",
    "SDPA_OPS",
]

_SCHEDULES = "torch.distributed.pipelining.schedules."
_ATEN = "torch.ops.aten."
PRIVATE_NAMES: dict[str, str] = {
    _SCHEDULES + "_Action": "the pipelining IR's action (stage, kind, microbatch): torch's CSV schedules and "
    "lowering speak it, and it has no public name",
    _SCHEDULES + "_ComputationType": "the IR's action kinds (F, I, W, B, SEND_F, ...); same reason",
    _SCHEDULES + "_PipelineScheduleRuntime": "the only torch runtime that executes per-rank action lists with "
    "FSDP actions; PipelineScheduleMulti's own loop never reduces FSDP gradients",
    _SCHEDULES + "_add_unshard_reshard": "lowering pass, for two-chain schedules, whose sends and receives torch's "
    "_add_send_recv cannot place (it sends across a chain's end)",
    _SCHEDULES + "_add_reduce_grad": "lowering pass for two-chain schedules (same reason)",
    _SCHEDULES + "_add_wait_send": "lowering pass (torch 2.15) for two-chain schedules (same reason)",
    _SCHEDULES + "_validate_send_waits": "torch 2.15's check of the send waits, after a lowering of the package's own",
    "torch.distributed.pipelining.stage._PipelineStageBase": "the stage without a module, for the simulator's "
    "stand-in stages (as torch's own tests build them)",
    "torch.distributed.pipelining.stage._RecvInfo": "a receive's description: units differ in length, and torch "
    "sizes every receive like unit 0's",
    "torch.distributed.pipelining._utils": "generate_stage_to_rank_mapping, torch's stage -> rank placements (loop, "
    "v), as torchtitan places stages",
    "torch.utils._pytree": "tree_map_only, to detach a stage's outputs, a tensor or a nest of them (torch has no "
    "public pytree)",
    "torch._dynamo": "config.recompile_limit: a compiled block meets one shape per unit length, and the default "
    "limit is below the lengths a schedule may cut",
    "torch._C": "_len_torch_dispatch_stack: whether a TorchDispatchMode (selective checkpointing's cache, fake "
    "tensors) sees the ops that run; torch has no public query, and unit attention runs as one op under one. "
    "_FunctionBase.apply, _functorch.unwrap_if_dead, _are_functorch_transforms_active: Function.apply as torch "
    "2.15 runs it in C, before 2.15 (function_apply)",
    "torch._utils": "_get_available_device_type, through which torchtitan 0.2.2 detects the device, falling back "
    "to 'cuda'; the CPU compatibility makes it fall back to 'cpu'",
    "torch._scaled_dot_product_flash_attention_for_cpu": "SDPA's CPU flash kernel, returning the log-sum-exp "
    "that the public SDPA hides and unit attention merges blocks by",
    _ATEN + "_scaled_dot_product_flash_attention_for_cpu_backward": "its backward, which takes the merged output "
    "and log-sum-exp",
    "torch._scaled_dot_product_flash_attention": "SDPA's CUDA flash kernel, with the log-sum-exp (same reason)",
    _ATEN + "_scaled_dot_product_flash_attention_backward": "its backward (same reason)",
    "torch._scaled_dot_product_cudnn_attention": "SDPA's cuDNN kernel, with the log-sum-exp (same reason)",
    _ATEN + "_scaled_dot_product_cudnn_attention_backward": "its backward (same reason)",
    "_prepare_schedule_with_comms": "torch's lowering of compute-only lists (FSDP, gradient reduction, send/recv, "
    "2.15's send waits), public only through _load_csv, from a file",
    "_step_microbatches": "runs pre-split microbatches before torch 2.14, which publishes step(arg_mbs=...)",
    "_maybe_compute_loss": "the runtime files each loss by position; a last stage runs units in any order",
    "_maybe_get_loss": "the same hook: the loss kept for the step is detached, or it pins the unit's graph",
    "_update_losses": "the same hook: losses are returned per unit id",
    "_loss_fn": "the schedule's loss function, which the loss hooks call",
    "_n_microbatches": "torch's microbatch count, which is the unit count here (N k)",
    "_stages": "the rank's stages, as the runtime holds them",
    "_has_backward": "whether a step runs backward (False in eval); torch keeps it private",
    "_prepare_forward_infra": "the stage hook after which receives are described, to resize them per unit",
    "_prepare_backward_infra": "the same hook for the gradients' receives",
    "_create_grad_recv_info": "a no-op on the simulator's stand-in stages, which receive nothing",
    "_validate_fwd_input": "torch 2.11 checks every unit's inputs against unit 0's shape; units differ",
    "_validate_fwd_outputs": "torch 2.11 checks every unit's outputs against unit 0's shape; units differ",
    "_get_init_p2p_neighbors_ops": "torch 2.11 warms up a link to a stage on the same rank, which gloo refuses",
}
"""Every private torch name the package uses, and why the public API does not serve."""

Action = _Action
ComputationType = _ComputationType

WAIT_SEND: bool = hasattr(_schedules, "_add_wait_send")
"""torch's lowering waits for every send (2.15): a lowering of the package's own must add the waits."""

PRE_SPLIT_STEP: bool = "arg_mbs" in inspect.signature(PipelineScheduleMulti.step).parameters
"""``step`` takes pre-split microbatches (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``; torch 2.14)."""

FINALIZE_GRADIENTS: bool = "finalize_gradients" in inspect.signature(PipelineScheduleMulti.step).parameters
"""``step(finalize_gradients=False)`` leaves FSDP gradients unreduced for another step (torch 2.15)."""

add_unshard_reshard = _schedules._add_unshard_reshard
add_reduce_grad = _schedules._add_reduce_grad
stage_to_rank_mapping = generate_stage_to_rank_mapping
DEVICE_TYPE_DETECTION = (torch._utils, torch._utils._get_available_device_type.__name__)
"""(owner, name) of the function torchtitan's device detection calls."""


def add_send_waits(lowered: dict[int, list[_Action]]) -> dict[int, list[_Action]]:
    """Lists with their sends and receives -> with the waits torch's runtime expects after each send
    (torch 2.15, checked as torch checks its own lowering); unchanged before 2.15."""
    if not WAIT_SEND:
        return lowered
    lowered = _schedules._add_wait_send(lowered)
    _schedules._validate_send_waits(lowered)
    return lowered


def detach_tensors(tree: Any) -> Any:
    """``tree`` (a tensor, or tuples, lists and dicts of them) with every tensor detached."""
    return tree_map_only(torch.Tensor, torch.Tensor.detach, tree)


def allow_recompiles(graphs: int) -> None:
    """Let torch.compile keep at least ``graphs`` graphs per compiled function (one per unit length)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode (selective activation checkpointing's cache, fake tensors) is active."""
    return torch._C._len_torch_dispatch_stack() > 0


_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]


def function_apply(fn: type[torch.autograd.Function], tensors: int) -> Callable[..., Any]:
    """``fn.apply`` (``fn`` defines no ``setup_context``; its first ``tensors`` arguments are tensors) as
    torch 2.15 runs it, in C. Before 2.15 ``Function.apply`` was Python: it binds every call's arguments
    for a ``setup_context`` and unwraps functorch's dead wrappers in a generator, some 30 interpreted lines
    a call, once per unit and layer here; without a functorch transform active that is the C apply of the
    arguments unwrapped, and under one it is torch's own."""
    in_c = torch.autograd.Function.__dict__["apply"] is _FUNCTION_APPLY
    if in_c or fn.setup_context is not torch.autograd.Function.setup_context:
        return fn.apply
    run = _FUNCTION_APPLY.__get__(None, fn)
    unwrap, transforms_active = torch._C._functorch.unwrap_if_dead, torch._C._are_functorch_transforms_active

    def apply(*args: Any) -> Any:
        if transforms_active():
            return fn.apply(*args)
        return run(*map(unwrap, args[:tensors]), *args[tensors:])

    return apply


class _SdpaOps:
    """The aten kernels behind SDPA that return the log-sum-exp, and their backwards, as attributes
    (``SdpaOps.cpu_flash(q, k, v, ...)``), bound once: the forwards as torch's C functions, the backwards
    as their ``default`` overloads. Called through its op packet (``torch.ops.aten.<op>(...)``) an op has
    its overload resolved at each call, some 10K host instructions, at each of four calls per unit and
    layer. A test stands a fake in for a CUDA-only op by setting the instance's attribute
    (:data:`SDPA_OPS` names each attribute's aten op)."""

    cpu_flash = torch._scaled_dot_product_flash_attention_for_cpu  # builtins: not bound as methods
    cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    flash = torch._scaled_dot_product_flash_attention
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    cudnn = torch._scaled_dot_product_cudnn_attention
    cudnn_backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default


SDPA_OPS: dict[str, str] = {
    "cpu_flash": "_scaled_dot_product_flash_attention_for_cpu",
    "cpu_flash_backward": "_scaled_dot_product_flash_attention_for_cpu_backward",
    "flash": "_scaled_dot_product_flash_attention",
    "flash_backward": "_scaled_dot_product_flash_attention_backward",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "cudnn_backward": "_scaled_dot_product_cudnn_attention_backward",
}
"""Each attribute of :data:`SdpaOps` -> its aten op's name."""


SdpaOps = _SdpaOps()


class UnitScheduleRuntime(_schedules._PipelineScheduleRuntime):
    """torch's action-list runtime for a schedule of units, torch's private hooks behind public names.

    torch counts units as microbatches. Losses are filed under their unit id (torch files them by the
    position they were computed at, which on a last stage that runs units out of order, or only some
    of them, is not the unit), and the one kept for the step is detached, since an attached loss pins
    its unit's graph until the step ends.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unit_losses: dict[int, torch.Tensor] = {}

    @property
    def stages(self) -> list:
        """This rank's stages."""
        return self._stages

    @property
    def num_units(self) -> int:
        """Units per step (torch's microbatches)."""
        return self._n_microbatches

    @property
    def runs_backward(self) -> bool:
        """Whether a step runs backward (False in ``eval``)."""
        return self._has_backward

    def lower(self, order: dict[int, list[_Action | None]]) -> None:
        """Lower compute-only lists with torch's own passes, as torch lowers its schedules."""
        self._prepare_schedule_with_comms(order)

    def use_lowered(self, stage_to_rank: dict[int, int], lowered: dict[int, list[_Action]]) -> None:
        """Run lists lowered by the schedule's own lowering (with :func:`add_send_waits`), whose
        stages sit on ranks as ``stage_to_rank`` says."""
        self.stage_index_to_group_rank = stage_to_rank
        for stage in self._stages:
            stage.stage_index_to_group_rank = stage_to_rank
        self.pipeline_order_with_comms = lowered

    def run_units(
        self,
        arg_units: list[tuple],
        kwarg_units: list[dict],
        target_units: list | None,
        losses: list | None,
        loss_kwargs: dict | None,
        finalize_gradients: bool,
    ) -> None:
        """Run one step on pre-split units (their outputs are the stages' to keep, not torch's):
        through ``step`` where torch takes pre-split microbatches (2.14), else its private loop."""
        if PRE_SPLIT_STEP:
            extra = {"finalize_gradients": finalize_gradients} if FINALIZE_GRADIENTS else {}
            units = {"arg_mbs": arg_units, "kwarg_mbs": kwarg_units, "target_mbs": target_units}
            super().step(**units, losses=losses, return_outputs=False, loss_kwargs=loss_kwargs, **extra)
            return
        if not finalize_gradients:
            raise ValueError(f"step(finalize_gradients=False) needs torch 2.15 or newer, not {torch.__version__}")
        # torch 2.11's loop takes no loss_kwargs (only torchtitan 0.3, on torch 2.14 and newer, gives any)
        extra = {"loss_kwargs": loss_kwargs} if loss_kwargs else {}
        self._step_microbatches(arg_units, kwarg_units, target_units, losses, False, **extra)

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        if stage.is_last and self._loss_fn is not None:
            # The loss function itself, not torch's _compute_loss, whose loss_kwargs torch 2.11 lacks.
            self.unit_losses[mb_index] = self._loss_fn(output, target_mbs[mb_index], **(loss_kwargs or {}))

    def _maybe_get_loss(self, stage, mb_index):
        if stage.is_last and self._loss_fn is not None:
            loss = self.unit_losses[mb_index]
            self.unit_losses[mb_index] = loss.detach()
            return loss
        return None

    def _update_losses(self, stages, losses):
        """Per-unit losses of this rank's last stages, in unit-id order; 0 for units they do not run."""
        if losses is not None and any(s.is_last for s in self._stages):
            zero = next(iter(self.unit_losses.values())).new_zeros(())
            losses[:] = [self.unit_losses.get(u, zero) for u in range(self._n_microbatches)]
        self.unit_losses.clear()


class UnitStageBase(PipelineStage):
    """torch's ``PipelineStage`` for units of differing lengths, torch's private hooks bridged.

    A subclass says each unit's length (:meth:`unit_length`); receive buffers, which torch sizes like
    unit 0's, are resized to it after torch prepares them.
    """

    def unit_length(self, unit_id: int) -> int:
        """Tokens of the unit behind torch's microbatch index ``unit_id``; receive shapes scale with it."""
        raise NotImplementedError

    # torch 2.11 checks each forward's inputs (on a first stage) and outputs against those of unit 0, shapes
    # and strides; units differ in length, and a first stage's are views of the batch. 2.13 checks none.
    def _validate_fwd_input(self, args: tuple, kwargs: dict) -> None:
        pass

    def _validate_fwd_outputs(self, outputs: tuple) -> None:
        pass

    # torch 2.11 warms up the links to both neighbouring stages, also where a neighbour is on this rank
    # (p = 1, a V's turn: the runtime hands tensors over locally), a send to itself that gloo refuses.
    # torch 2.13 and later ask no stage for these.
    def _get_init_p2p_neighbors_ops(self) -> list:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def _prepare_forward_infra(self, num_microbatches, *args, **kwargs):
        # Metadata inference runs the chunk on unit 0 outside any unit: plain causal attention, nothing
        # cached. (torch 2.13 also passes has_backward; torch 2.11 does not.)
        out = super()._prepare_forward_infra(num_microbatches, *args, **kwargs)
        self._size_receives(self.args_recv_info)
        return out

    def _prepare_backward_infra(self, num_microbatches, *args, **kwargs):
        out = super()._prepare_backward_infra(num_microbatches, *args, **kwargs)
        self._size_receives(self.grad_recv_info)
        return out

    def _size_receives(self, infos_by_unit: dict) -> None:
        """Resize the receives of each unit, described (and before torch 2.15 allocated) for unit 0, to
        the unit's length; shapes scale, so a tensor whose sequence is sharded (TP's sequence parallel)
        keeps its fraction. torch 2.13 adds metadata beside the buffer, which 2.15 allocates from just
        before each receive; torch 2.11 has no metadata and describes model inputs by placeholders."""
        first = self.unit_length(0)
        for unit_id, infos in infos_by_unit.items():
            length = self.unit_length(unit_id)

            def scaled(shape: torch.Size, length: int = length) -> torch.Size:
                return torch.Size([shape[0], shape[1] * length // first, *shape[2:]])

            for info in infos:
                if not isinstance(info, _RecvInfo) or getattr(info, "is_root_arg", False):
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
                    info.buffer = torch.empty(shape, dtype=dtype, device=self.device, requires_grad=grad)


class MockStage(_PipelineStageBase):
    """A stage without module or process group, enough for torch's schedule constructors and
    lowering (the trick of torch's test_schedule.py MockPipelineStage)."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int = 0) -> None:
        self.submod = None
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.group = None

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, *args, **kwargs):
        pass

    def _prepare_backward_infra(self, *args, **kwargs):
        pass


def torch_lowering(
    order: dict[int, list[_Action | None]], num_stages: int, num_units: int
) -> tuple[dict[int, list[_Action]] | None, dict[int, int]]:
    """torch's own lowering of compute-only lists (``_prepare_schedule_with_comms``, the passes of the
    installed torch), run on stand-in stages: (the lists the runtime runs, stage -> rank). The lists
    are None where torch finds no order for the sends and receives (a deadlock)."""
    held = sorted({a.stage_index for a in order[0] if a is not None}) or [0]
    runtime = _schedules._PipelineScheduleRuntime([MockStage(s, num_stages, len(order)) for s in held], num_units)
    try:
        runtime._prepare_schedule_with_comms(order)
    except AssertionError as e:
        if "can't schedule sends/recvs" not in str(e):
            raise
        return None, dict(runtime.stage_index_to_group_rank)
    return runtime.pipeline_order_with_comms, dict(runtime.stage_index_to_group_rank)
