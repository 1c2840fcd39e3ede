"""``llama3_seq``: torchtitan's Llama 3 with chunk-aware attention under the name jobs gave it first (an
alias of ``llama3``, :mod:`torchtitan_seq.titan.v022.models.train_specs`).

Every Llama 3 flavor is offered under its torchtitan name; the block-causal ones
(``debugmodel_flex_attn``, ``8B_varlen``, ...) attend by the batch's document ids
(:mod:`torchtitan_seq.runtime.documents`), whatever kernel runs.
"""

from __future__ import annotations

from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.models.llama3 import llama3_args as _llama3_flavors
from torchtitan.protocols.train_spec import TrainSpec

from torchtitan_seq.titan.v022.models.sequence_model import sequence_model_class
from torchtitan_seq.titan.v022.models.train_specs import sequence_train_spec

__all__ = ["SeqTransformer", "seq_llama3_flavors", "get_train_spec"]

SeqTransformer = sequence_model_class(Transformer)
"""torchtitan's Llama 3 whose attention can run one (microbatch, subsequence) unit at a time."""

seq_llama3_flavors: dict[str, TransformerModelArgs] = dict(_llama3_flavors)
"""Llama 3's flavors under their own names: SDPA ones causal, flex and varlen ones block-causal."""


def get_train_spec() -> TrainSpec:
    """torchtitan's Llama 3 train spec with the sequence schedules' model, pipelining, loss and metrics.

    Returns:
        :func:`~torchtitan_seq.titan.v022.models.train_specs.sequence_train_spec` of ``llama3``.
    """
    return sequence_train_spec("llama3")
