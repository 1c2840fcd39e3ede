"""The one place torchtitan_seq registers with torchtitan.

:func:`register` adds, through torchtitan's own extension points:

* the train spec ``llama3_seq``: Llama 3 with chunk-aware attention
  (:class:`~torchtitan_seq.model.SeqTransformer`), our pipelining function
  (sequence schedules by name, torch's otherwise), a token-normalised loss,
  and metrics that include activation memory;
* the shipped datasets ``seqpp_text`` and ``seqpp_text_validation`` in
  torchtitan's dataset table (its documented place for new datasets).
"""

from __future__ import annotations

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.hf_datasets import text_datasets
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.protocols import train_spec

from . import data
from .loss import TokenNormalizedLoss
from .metrics import build_seq_metrics_processor
from .model import SeqTransformer, seq_llama3_flavors
from .pipeline import pipeline_sequence_llm

__all__ = ["MODEL_NAME", "register"]

MODEL_NAME = "llama3_seq"


def build_loss(job_config, **kwargs) -> TokenNormalizedLoss:
    return TokenNormalizedLoss(build_cross_entropy_loss(job_config, **kwargs))


def register() -> None:
    """Make the model, its train spec and the shipped datasets known to torchtitan (idempotent)."""
    text_datasets.DATASETS.setdefault(data.DATASET_NAME, data.dataset_config())
    text_datasets.DATASETS.setdefault(data.VALIDATION_DATASET_NAME, data.validation_dataset_config())
    if MODEL_NAME in train_spec._extra_train_specs:
        return
    base = llama3_train_spec()
    train_spec.register_train_spec(
        MODEL_NAME,
        train_spec.TrainSpec(
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
        ),
    )
