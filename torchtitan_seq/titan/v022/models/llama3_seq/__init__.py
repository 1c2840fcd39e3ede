"""``llama3_seq``: torchtitan's Llama 3 with chunk-aware attention (:mod:`.model`), and its train spec.

Laid out as torchtitan lays out its own models (``torchtitan/models/llama3``).
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.protocols.train_spec import TrainSpec

from torchtitan_seq.runtime.loss import TokenNormalizedLoss
from torchtitan_seq.titan.v022.metrics import build_seq_metrics_processor
from torchtitan_seq.titan.v022.models.llama3_seq.model import SeqTransformer, seq_llama3_flavors
from torchtitan_seq.titan.v022.pipeline import pipeline_sequence_llm

__all__ = ["SeqTransformer", "seq_llama3_flavors", "get_train_spec"]


def get_train_spec() -> TrainSpec:
    """torchtitan's Llama 3 train spec with the sequence schedules' model, pipelining, loss and metrics.

    Returns:
        Llama 3's spec with :class:`SeqTransformer` and its flavors, :func:`pipeline_sequence_llm`
        (sequence schedules by name, torch's otherwise), the cross-entropy loss wrapped in a
        :class:`~torchtitan_seq.runtime.loss.TokenNormalizedLoss` and a metrics processor that also
        reports activation memory and the pipeline's bubble.
    """
    return dataclasses.replace(
        llama3_train_spec(),
        model_cls=SeqTransformer,
        model_args=seq_llama3_flavors,
        pipelining_fn=pipeline_sequence_llm,
        build_loss_fn=lambda job_config, **kwargs: TokenNormalizedLoss(build_cross_entropy_loss(job_config, **kwargs)),
        build_metrics_processor_fn=build_seq_metrics_processor,
    )
