"""The train specs of torchtitan 0.2.2's model families that sequence schedules run, under torchtitan's
own model names.

Each is the family's own spec (flavors, parallelisation, optimizers, data, tokenizer, checkpoint
adapter) with four things of torchtitan_seq's: the model class with chunk-aware attention
(:func:`~torchtitan_seq.titan.v022.models.sequence_model.sequence_model_class`), the pipelining function
(:func:`~torchtitan_seq.titan.v022.pipeline.pipeline_sequence_llm`: sequence schedules by name, torch's
otherwise), the family's loss normalised by the step's tokens
(:class:`~torchtitan_seq.runtime.loss.TokenNormalizedLoss`) and a metrics processor that also reports
activation memory and the pipeline's bubble.
"""

from __future__ import annotations

import dataclasses
import importlib

from torchtitan.protocols.train_spec import TrainSpec

from torchtitan_seq.runtime.loss import TokenNormalizedLoss
from torchtitan_seq.titan.v022.metrics import build_seq_metrics_processor
from torchtitan_seq.titan.v022.models.sequence_model import sequence_model_class
from torchtitan_seq.titan.v022.pipeline import pipeline_sequence_llm

__all__ = ["SEQUENCE_FAMILIES", "FLEX_FAMILIES", "ALIASES", "sequence_train_spec"]

FLEX_FAMILIES: tuple[str, ...] = ("deepseek_v3", "llama4", "gpt_oss")
"""The families whose attention reads more than Llama 3's (MLA, attention chunks, sliding windows, sinks:
:mod:`~torchtitan_seq.titan.v022.models.family_adapters`), flex attention in torchtitan's own flavors."""

SEQUENCE_FAMILIES: tuple[str, ...] = ("llama3", "qwen3", *FLEX_FAMILIES)
"""torchtitan's model names whose specs are registered with chunk-aware attention."""

ALIASES: dict[str, str] = {"llama3_seq": "llama3"}
"""Other names jobs may give a family by."""

UNTIED_FLAVORS: dict[str, dict[str, str]] = {"qwen3": {"debugmodel_untied": "debugmodel"}}
"""Per family, flavors added beside its own: a flavor of its own with untied embeddings, which a pipeline
can split (the small Qwen3 flavors tie theirs), as torchtitan 0.3's Qwen3 ships ``debugmodel_untied``."""


def sequence_train_spec(name: str) -> TrainSpec:
    """The train spec of family ``name`` with torchtitan_seq's model, pipelining, loss and metrics.

    Args:
        name: a model name of :data:`SEQUENCE_FAMILIES` (torchtitan's package ``torchtitan.models.<name>``).

    Returns:
        The family's spec with those four replaced (see the module docstring).
    """
    spec = importlib.import_module(f"torchtitan.models.{name}").get_train_spec()
    build_loss = spec.build_loss_fn
    untied = {
        flavor: dataclasses.replace(spec.model_args[tied], enable_weight_tying=False)
        for flavor, tied in UNTIED_FLAVORS.get(name, {}).items()
    }
    return dataclasses.replace(
        spec,
        model_args={**spec.model_args, **untied},
        model_cls=sequence_model_class(spec.model_cls),
        pipelining_fn=pipeline_sequence_llm,
        build_loss_fn=lambda job_config, **kwargs: TokenNormalizedLoss(build_loss(job_config, **kwargs)),
        build_metrics_processor_fn=build_seq_metrics_processor,
    )
