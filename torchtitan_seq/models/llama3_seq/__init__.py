"""``llama3_seq``: torchtitan's Llama 3 with chunk-aware attention, and its train spec.

Laid out as torchtitan lays out its own models (``torchtitan/models/llama3``):
the model in :mod:`.model`, the train spec from :func:`get_train_spec`, which
:func:`torchtitan_seq.registration.register` registers.
"""

from __future__ import annotations

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.protocols.train_spec import TrainSpec

from ...loss import TokenNormalizedLoss
from ...metrics import build_seq_metrics_processor
from ...pipeline import pipeline_sequence_llm
from .model import SeqTransformer, seq_llama3_flavors, unit_positions

__all__ = ["SeqTransformer", "seq_llama3_flavors", "unit_positions", "get_train_spec"]


def build_loss(job_config, **kwargs) -> TokenNormalizedLoss:
    return TokenNormalizedLoss(build_cross_entropy_loss(job_config, **kwargs))


def get_train_spec() -> TrainSpec:
    """Llama 3's train spec with our model, pipelining function, loss and metrics."""
    base = llama3_train_spec()
    return TrainSpec(
        model_cls=SeqTransformer,
        model_args=seq_llama3_flavors,
        parallelize_fn=base.parallelize_fn,
        pipelining_fn=pipeline_sequence_llm,
        build_optimizers_fn=base.build_optimizers_fn,
        build_lr_schedulers_fn=base.build_lr_schedulers_fn,
        build_dataloader_fn=base.build_dataloader_fn,
        build_tokenizer_fn=base.build_tokenizer_fn,
        build_loss_fn=build_loss,
        build_validator_fn=base.build_validator_fn,
        build_metrics_processor_fn=build_seq_metrics_processor,
        state_dict_adapter=base.state_dict_adapter,
    )
