"""torch's private names, in one place.

Everything the package takes from torch that torch does not publish is reached through this module:
the pipelining IR and its lowering passes, the runtime's and the stage's hooks, receive buffers, the
attention ops behind SDPA, and three settings. Each entry of :data:`PRIVATE_NAMES` says why the
public API does not serve; ``tests/unit/test_torch_internals.py`` lists every private torch name the
package uses and fails on one used anywhere else. Where a release of torch changed a private name,
the difference is bridged here, by feature (``hasattr``, a signature), not by version number.
The code that uses these names lives with its concept (the loss filing in
:mod:`torchtitan_seq.schedules.unit_losses`, receive sizing in :mod:`torchtitan_seq.schedules.receives`,
the SDPA ops' binding in :mod:`torchtitan_seq.attention.sdpa_ops`, the simulator's stand-in stages in
:mod:`torchtitan_seq.simulate.stand_in`): here torch's private hooks only call public methods.

Checked against torch 2.11 (benchmarks/gpu_check.sh on the GPU machine), 2.13.0, 2.14.1 and 2.15.0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.config
import torch._functorch.aot_autograd
import torch._utils
from torch import nn
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
    "RecvInfo",
    "WAIT_SEND",
    "PRE_SPLIT_STEP",
    "FINALIZE_GRADIENTS",
    "UnitScheduleRuntime",
    "UnitStageBase",
    "ModulelessStage",
    "add_send_waits",
    "add_unshard_reshard",
    "add_reduce_grad",
    "stage_to_rank_mapping",
    "detach_tensors",
    "allow_recompiles",
    "keep_async_collective_input_grads",
    "ASYNC_COLLECTIVE_REPAIRABLE",
    "dispatch_mode_active",
    "top_saved_tensors_hooks",
    "persistent_buffers",
    "C_FUNCTION_APPLY",
    "unwrap_if_dead",
    "functorch_transforms_active",
    "DEVICE_TYPE_DETECTION",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "flash_attention",
    "flash_attention_backward",
    "cudnn_attention",
    "cudnn_attention_backward",
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
    "torch._functorch": "aot_autograd.process_inputs (and _aot_autograd.frontend_utils', its home), which makes "
    "a compiled graph's inputs fake and drops requires_grad from AsyncCollectiveTensor inputs; the only place "
    "to keep it, which torch has no setting for (keep_async_collective_input_grads)",
    "torch._C": "_len_torch_dispatch_stack: whether a TorchDispatchMode (selective checkpointing's cache, fake "
    "tensors) sees the ops that run; torch has no public query, and unit attention runs as one op under one. "
    "_autograd._top_saved_tensors_default_hooks: whether saved-tensor hooks are active (no public query). "
    "_FunctionBase.apply, _functorch.unwrap_if_dead, _are_functorch_transforms_active: Function.apply as torch "
    "2.15 runs it in C, before 2.15 (attention.function_apply)",
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
    "_non_persistent_buffers_set": "which of a module's buffers are state (an MoE's expert bias) and which are "
    "caches (RoPE tables); only state_dict() tells otherwise, which gathers every parameter's shards",
}
"""Every private torch name the package uses, and why the public API does not serve."""

Action = _Action
ComputationType = _ComputationType
RecvInfo = _RecvInfo

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


def keep_async_collective_input_grads() -> bool:
    """Give a compiled graph's input that is an AsyncCollectiveTensor requiring grad its gradient back;
    whether the repair is in place (False: a torch without the function it wraps).

    Under TP with sequence parallel, torchtitan's embedding (``RowwiseParallel``, output ``Shard(1)``) hands
    the first compiled block an AsyncCollectiveTensor that requires grad. torch 2.13 to 2.15's
    ``process_inputs`` (``_aot_autograd.frontend_utils``) fakes it as ``trigger_wait()``'s plain result,
    without requires_grad: the input is traced as constant, and the embedding's DTensor backward gets plain
    zeros (``'Tensor' object has no attribute '_local_tensor'``), with torch's schedules too. The repair marks
    those fakes as requiring grad again (torch's upstream repair: "Preserve requires_grad when unwrapping ACT
    inputs in process_inputs"). Installed by every sequence pipeline stage and by ``torchtitan_seq.train``
    before anything compiles; calling it again changes nothing.
    """
    process_inputs = getattr(torch._functorch.aot_autograd, "process_inputs", None)
    if process_inputs is None:
        return False
    if getattr(process_inputs, "keeps_input_grads", False):
        return True

    def keeping_input_grads(flat_args: list, *args: Any, **kwargs: Any) -> Any:
        needed = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor) and a.requires_grad]
        out = process_inputs(flat_args, *args, **kwargs)
        # (fakes, the ACT inputs' places) since torch unwraps ACT inputs; the fakes alone before
        fakes = out[0] if isinstance(out, tuple) else out
        for i in needed:
            # a fake without requires_grad is a leaf: only the flag is missing
            if isinstance(fakes[i], torch.Tensor) and not fakes[i].requires_grad:
                fakes[i].requires_grad_(True)
        return out

    keeping_input_grads.keeps_input_grads = True
    # aot_autograd calls the name it imported from its home module: both are replaced
    for owner in (torch._functorch.aot_autograd, torch._functorch._aot_autograd.frontend_utils):
        if getattr(owner, "process_inputs", None) is process_inputs:
            owner.process_inputs = keeping_input_grads
    return True


ASYNC_COLLECTIVE_REPAIRABLE: bool = hasattr(torch._functorch.aot_autograd, "process_inputs")
"""Whether :func:`keep_async_collective_input_grads` can repair this torch (it has the function the repair
wraps): compiled blocks under tensor parallelism get their first input's gradient."""


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers of ``module`` and its submodules that its state dict holds, in module
    order; the name is the buffer's own (e.g. ``expert_bias``)."""
    return [
        (name, b)
        for m in module.modules()
        for name, b in m.named_buffers(recurse=False)
        if name not in m._non_persistent_buffers_set
    ]


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode (selective activation checkpointing's cache, fake tensors) is active."""
    return torch._C._len_torch_dispatch_stack() > 0


C_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]
"""``Function.apply`` as C runs it (torch 2.15's ``Function.apply`` itself), for
:func:`~torchtitan_seq.attention.function_apply.function_apply`."""
unwrap_if_dead = torch._C._functorch.unwrap_if_dead
"""functorch's unwrapping of a dead wrapper, which the Python ``apply`` before 2.15 does to each argument."""
functorch_transforms_active = torch._C._are_functorch_transforms_active
"""Whether a functorch transform (``torch.func.grad``, ...) is active: then torch's own ``apply`` runs."""
top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
"""``(False)`` -> the innermost saved-tensor hooks (checkpointing's: saves packed, not kept), or None."""

# SDPA's kernels that return the log-sum-exp, and their backwards' op packets (bound for unit attention in
# torchtitan_seq.attention.sdpa_ops)
cpu_flash_attention = torch._scaled_dot_product_flash_attention_for_cpu
cpu_flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
flash_attention = torch._scaled_dot_product_flash_attention
flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward
cudnn_attention = torch._scaled_dot_product_cudnn_attention
cudnn_attention_backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward


class UnitScheduleRuntime(_schedules._PipelineScheduleRuntime):
    """torch's action-list runtime for a schedule of units, torch's private names behind public ones.

    torch counts units as microbatches. Its loss hooks call :meth:`compute_loss`, :meth:`backward_loss`
    and :meth:`report_losses`, which a subclass defines (the loss filing of
    :class:`~torchtitan_seq.schedules.unit_losses.UnitLossRuntime`); a runtime that only lowers lists
    (the simulator's) needs none.
    """

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

    @property
    def loss_fn(self) -> Callable[..., torch.Tensor] | None:
        """The schedule's loss function (None: no stage computes a loss)."""
        return self._loss_fn

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

    def compute_loss(self, stage: Any, output: Any, target_units: list, unit_id: int, loss_kwargs: dict | None) -> None:
        """After unit ``unit_id``'s forward on ``stage``, its loss where the stage computes one
        (``target_units``: the targets of every unit)."""
        raise NotImplementedError

    def backward_loss(self, stage: Any, unit_id: int) -> torch.Tensor | None:
        """The loss unit ``unit_id``'s backward on ``stage`` starts from (None: a received gradient)."""
        raise NotImplementedError

    def report_losses(self, losses: list | None) -> None:
        """At the end of a step: the step's losses into ``losses`` (None: not asked for)."""
        raise NotImplementedError

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        self.compute_loss(stage, output, target_mbs, mb_index, loss_kwargs)

    def _maybe_get_loss(self, stage, mb_index):
        return self.backward_loss(stage, mb_index)

    def _update_losses(self, stages, losses):
        self.report_losses(losses)


class UnitStageBase(PipelineStage):
    """torch's ``PipelineStage`` for units of differing lengths, torch's private hooks bridged.

    A subclass says each unit's length (:meth:`unit_length`) and resizes its receives, which torch
    describes like unit 0's (:meth:`resize_receives`), after torch prepares them.
    """

    def unit_length(self, unit_id: int) -> int:
        """Tokens of the unit behind torch's microbatch index ``unit_id``; receive shapes scale with it."""
        raise NotImplementedError

    def resize_receives(self, receives_by_unit: dict) -> None:
        """Resize each unit's receives (unit id -> :data:`RecvInfo` and torch 2.11's placeholders for model
        inputs), which torch describes, and before 2.15 allocates, like unit 0's."""
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
        # cached. It leaves the chunk's buffers as they were: an MoE layer counts the tokens it routes
        # (torchtitan's tokens_per_expert), and these are made up. (torch 2.13 also passes has_backward;
        # torch 2.11 does not.)
        buffers = [(b, b.clone()) for b in self.submod.buffers()]
        out = super()._prepare_forward_infra(num_microbatches, *args, **kwargs)
        with torch.no_grad():
            for buffer, before in buffers:
                # only those it changed: the inference's graph, which torch's backward inference reads,
                # may hold the others (a RoPE table), and a copy would bump their versions
                if not torch.equal(buffer, before):
                    buffer.copy_(before)
        self.resize_receives(self.args_recv_info)
        return out

    def _prepare_backward_infra(self, num_microbatches, *args, **kwargs):
        out = super()._prepare_backward_infra(num_microbatches, *args, **kwargs)
        self.resize_receives(self.grad_recv_info)
        return out


class ModulelessStage(_PipelineStageBase):
    """torch's stage base for a stage without module or process group: the hooks that would prepare its
    sends and receives do nothing. A subclass sets the attributes torch's schedule constructors and
    lowering read (:class:`~torchtitan_seq.simulate.stand_in.MockStage`)."""

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, *args, **kwargs):
        pass

    def _prepare_backward_infra(self, *args, **kwargs):
        pass
