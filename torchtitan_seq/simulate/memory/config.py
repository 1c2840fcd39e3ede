"""The job the memory model sizes, as torchtitan's config names it (:class:`MemoryConfig`), and the
dtypes and activation checkpointing modes it may name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from torchtitan_seq.runtime.reach import KVContextMode
from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.titan.flavors import ModelShape, flavor_shapes

if TYPE_CHECKING:  # torchtitan is imported where a flavor is looked up, not with this module
    from torchtitan.models.llama3 import TransformerModelArgs


DType = Literal["float32", "bfloat16", "float16", "float8_e4m3fn"]
"""The dtypes a config may name (torchtitan's names)."""
DTYPE_BYTES: dict[DType, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}

ACMode = Literal["none", "selective", "full"]
"""``activation_checkpoint.mode``s the model covers, least recomputation first."""
Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class MemoryConfig:
    """One training job, as torchtitan's config names it: the model, the job's shape and the rest."""

    model: str | TransformerModelArgs
    """A flavor name as the tools take it (a ``llama3_seq`` flavor, or ``family:flavor`` of any family:
    :mod:`~torchtitan_seq.simulate.flavors`), or the model's arguments or shape."""
    shape: JobShape
    """The job's shape as the runtime derives it (:class:`~torchtitan_seq.runtime.shape.JobShape`): S, the cut
    into k units (1 for torch's schedules), the TP degree (with sequence parallel, as torchtitan applies
    it), N microbatches per step and pipeline, v (None: the schedule's own). Its ``whole`` follows
    ``schedule``: torch's schedules run each sequence uncut."""
    schedule: str = "1F1B"
    """A name of ``SEQUENCE_SCHEDULES`` or one of torch's schedules."""
    pp: int = 1
    """Pipeline ranks."""
    split_backward: bool = False
    """Separate input- and weight-gradient passes (activations live until W)."""
    microbatch_size: int = 1
    """b, sequences per microbatch (``pipeline_parallel_microbatch_size``)."""
    dp_shard: int = 1
    """``data_parallel_shard_degree``; FSDP shards over it and the CP degree (the shape's ``cp``), and is
    on when their product is above 1, as torchtitan builds its mesh."""
    activation_checkpoint: ACMode = "none"
    """``activation_checkpoint.mode``."""
    selective_ac_option: str = "2"
    """``activation_checkpoint.selective_ac_option``: ``"op"`` or every n-th layer (torchtitan's default 2)."""
    device: Device = "cuda"
    """Where it runs: RMSNorm saves more on the CPU (its composite form, in float32)."""
    param_dtype: DType = "float32"
    """Master weights (FSDP's sharded parameters; torchtitan's parameters)."""
    compute_dtype: DType | None = None
    """Activations and the compute copy of the weights; None: torchtitan's rule,
    ``mixed_precision_param`` under FSDP (or with neither PP nor TP: autocast), else ``param_dtype``
    (torchtitan turns mixed precision off with PP or TP and no FSDP)."""
    mixed_precision_param: DType = "bfloat16"
    """``training.mixed_precision_param``."""
    mixed_precision_reduce: DType = "float32"
    """``training.mixed_precision_reduce``: FSDP's gradient dtype."""
    optimizer_states: int = 2
    """States per parameter (AdamW: 2)."""
    optimizer_dtype: DType = "float32"
    """dtype of the optimizer states."""
    kv_context: KVContextMode = "reach"
    """``sequence_pipeline.kv_context``: what a layer of bounded reach keeps of earlier units, only what
    later units read (``"reach"``; not under CP) or every earlier position (``"full"``); ``"latent"``: an MLA
    model's layers keep their latent (:mod:`.stage_bytes`)."""
    kv_offload: bool = False
    """``sequence_pipeline.kv_offload``: the KV context's arenas leave the device while no pass of their stage
    reads them (:func:`~torchtitan_seq.runtime.kv_offload.offload_spans`)."""

    def __post_init__(self) -> None:
        # Whether the job cuts its sequences is the schedule's to say, not the caller's.
        object.__setattr__(self, "shape", replace(self.shape, whole=self.schedule not in SEQUENCE_SCHEDULES))
        for name in ("param_dtype", "mixed_precision_param", "mixed_precision_reduce", "optimizer_dtype"):
            dtype_bytes(getattr(self, name), name)
        if self.compute_dtype is not None:
            dtype_bytes(self.compute_dtype, "compute_dtype")
        if self.kv_context not in ("reach", "full", "latent"):
            raise ValueError(f"kv_context = {self.kv_context!r}: use 'reach', 'full' or 'latent'")
        if self.activation_checkpoint not in ("none", "selective", "full"):
            raise ValueError(
                f"activation_checkpoint = {self.activation_checkpoint!r}: the memory model knows "
                "'none', 'selective' and 'full' ('memory_budget' depends on the compiler)"
            )
        option = self.selective_ac_option
        if self.activation_checkpoint == "selective" and option != "op" and not (option.isdigit() and int(option)):
            raise ValueError(f"selective_ac_option = {option!r}: use 'op' or a positive integer")
        counts = {
            name: getattr(self.shape, name) for name in ("seq_len", "num_subsequences", "tp", "cp", "microbatches")
        }
        counts |= {"pp": self.pp, "microbatch_size": self.microbatch_size, "dp_shard": self.dp_shard}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} = {value}: it must be at least 1")

    @property
    def model_args(self) -> TransformerModelArgs | ModelShape:
        if not isinstance(self.model, str):
            return self.model
        if (shape := flavor_shape(self.model)) is None:
            raise ValueError(
                f"model = {self.model!r}: use one of {sorted(flavor_shapes)}, FAMILY:FLAVOR or TransformerModelArgs"
            )
        return shape

    @property
    def seq_len(self) -> int:
        """S, tokens per sequence (the shape's), which the byte counts read throughout."""
        return self.shape.seq_len

    @property
    def tp(self) -> int:
        """t, the TP degree (the shape's), which divides most byte counts."""
        return self.shape.tp

    @property
    def cp(self) -> int:
        """c, the CP degree (the shape's): a rank holds 1/c of each unit's tokens, and the whole K/V."""
        return self.shape.cp

    @property
    def fsdp_degree(self) -> int:
        """The ranks FSDP shards over: data-parallel shards x CP."""
        return self.dp_shard * self.cp

    @property
    def fsdp(self) -> bool:
        return self.fsdp_degree > 1

    @property
    def activation_dtype(self) -> str:
        """The compute dtype: activations, and the weights' compute copy."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        if self.fsdp or (self.pp == 1 and self.tp == 1):
            return self.mixed_precision_param
        return self.param_dtype


def dtype_bytes(dtype: str, name: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{name} = {dtype!r}: use one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]
