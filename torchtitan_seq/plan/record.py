"""A plan: one configuration with what the models predict for it, and the settings that run it in
torchtitan (``./run_train.sh`` overrides, a TOML snippet for torchtitan 0.2.2, a config function for 0.3)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from torchtitan_seq.runtime.partition import Partition
from torchtitan_seq.runtime.reach import KVContextMode
from torchtitan_seq.runtime.shape import LENGTH_MULTIPLE
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.flavors import split_flavor
from torchtitan_seq.simulate.memory import ACMode

# torchtitan 0.3's activation checkpointing, a config class per mode (None: off).
_AC_03 = {"none": "None", "full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}


@dataclass(frozen=True)
class Plan:
    """One configuration and what the models predict for it."""

    schedule: str
    pp: int
    tp: int
    dp_shard: int
    num_subsequences: int
    partition: Partition
    stages_per_rank: int
    activation_checkpoint: ACMode
    tokens_per_s: float
    """Whole job (every data-parallel replica)."""
    peak_memory_gib: float
    """The largest over pipeline ranks."""
    bubble_ratio: float
    """Idle share of the busiest rank's step."""
    fits: bool
    lengths: tuple[int, ...] = ()
    """The subsequence lengths evaluated, which the runtime cuts with :meth:`overrides`."""
    length_multiple: int = LENGTH_MULTIPLE
    """``sequence_pipeline.length_multiple`` of the job (the lengths are multiples of it and of tp)."""
    cp: int = 1
    """``context_parallel_degree`` (sequence schedules only)."""
    kv_context: KVContextMode = "reach"
    """``sequence_pipeline.kv_context`` (sequence schedules only; set where not the default)."""
    kv_offload: bool = False
    """``sequence_pipeline.kv_offload``: proposed where the configuration fits only with it."""

    def overrides(self, flavor: str, seq_len: int, local_batch_size: int) -> str:
        """The configuration as ``./run_train.sh`` arguments (a ``family:flavor`` with its torchtitan model name)."""
        family, name = split_flavor(flavor)
        args = {
            **({"model.name": family} if name != flavor else {}),
            "model.flavor": name,
            "training.seq_len": seq_len,
            "training.local_batch_size": local_batch_size,
            "parallelism.pipeline_parallel_degree": self.pp,
            "parallelism.tensor_parallel_degree": self.tp,
            "parallelism.data_parallel_shard_degree": self.dp_shard,
            **({"parallelism.context_parallel_degree": self.cp} if self.cp > 1 else {}),
            "parallelism.pipeline_parallel_microbatch_size": 1,
            "parallelism.pipeline_parallel_schedule": self.schedule,
            "activation_checkpoint.mode": self.activation_checkpoint,
        }
        if self.schedule in SEQUENCE_SCHEDULES:
            args["sequence_pipeline.num_subsequences"] = self.num_subsequences
            args["sequence_pipeline.partition"] = self.partition
            args["sequence_pipeline.length_multiple"] = self.length_multiple
            if self.kv_context != "reach":
                args["sequence_pipeline.kv_context"] = self.kv_context
            if self.kv_offload:
                args["sequence_pipeline.kv_offload"] = True  # a flag, as torchtitan's command line takes it
        return " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in args.items())

    def config_function(self, flavor: str, seq_len: int, local_batch_size: int) -> str:
        """The configuration as a torchtitan 0.3 config function: the shipped job of ``flavor``'s size
        (:mod:`torchtitan_seq.recipes`) with the plan's settings, for ``--module`` your file ``--config plan``."""
        family, name = split_flavor(flavor)
        base = "llama3_debugmodel" if name.startswith("debugmodel") else "llama3_8b_32k"
        block_causal = "_block_causal" if name.endswith(("_flex_attn", "_flex", "_varlen_attn", "_varlen")) else ""
        own = name != flavor  # another family than Llama 3: its spec by torchtitan's model name
        spec, spec_args = ("sequence_model_spec", f"{family!r}, {name!r}") if own else ("seq_llama3", f"{name!r}")
        lines = [
            "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: F401",
            f"from torchtitan_seq.recipes import {base}{block_causal}_seq1f1b",
            f"from torchtitan_seq.titan.v03.model import {spec}",
            "from torchtitan_seq.titan.v03.pipeline import pipeline_sequence_llm",
            "",
            "",
            "def plan():",
            f"    config = {base}{block_causal}_seq1f1b()",
            f"    config.model_spec = {spec}({spec_args}, pipeline_sequence_llm)",
        ]
        for arg in self.overrides(flavor, seq_len, local_batch_size).split(" --"):
            key, _, value = arg.removeprefix("--").partition(" ")
            section, name = key.split(".")
            if section == "model":
                continue
            if section == "activation_checkpoint":
                lines.append(f"    config.activation_checkpoint = {_AC_03[value]}")
            else:
                python = "True" if not value else value if value.isdigit() else json.dumps(value)  # "": a flag
                lines.append(f"    config.{key} = {python}")
        return "\n".join([*lines, "    return config"])

    def toml(self, flavor: str, seq_len: int, local_batch_size: int) -> str:
        """The configuration as a torchtitan TOML snippet."""
        sections: dict[str, dict[str, object]] = {}
        for arg in self.overrides(flavor, seq_len, local_batch_size).split(" --"):
            key, _, value = arg.removeprefix("--").partition(" ")
            section, name = key.split(".")
            sections.setdefault(section, {})[name] = True if not value else int(value) if value.isdigit() else value
        return "\n\n".join(
            f"[{section}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items())
            for section, fields in sections.items()
        )
