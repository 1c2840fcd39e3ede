"""torchtitan 0.3's validator, its batches prepared as :class:`~torchtitan_seq.titan.v03.trainer.SeqTrainer`
prepares training's.

0.3's validator runs a pipeline's schedule forward only (its ``eval``, on microbatches as the trainer's
step hands them over) and divides the summed token losses by the validation tokens. A sequence schedule
runs ``eval`` as it runs a step, unit by unit, with the same cut. What it is handed differs from what
the trainer hands it: 0.3's validator passes the dataloader's per-document ``positions`` (which a
sequence schedule refuses, and the trainer drops: RoPE at sequence positions) and builds masks for 0.3's
own flex and varlen attention only, where a block-causal flavor of ``<family>_seq`` attends by the
batch's document ids. :class:`SeqValidator` hands it what the trainer does, under every schedule, so that
validation and training see the same model. Its validation set is the shipped one by default, so
validation reads nothing from the Hub.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.validate import Validator
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from torchtitan_seq.runtime.documents import document_ids
from torchtitan_seq.titan.data import VALIDATION_DATASET_NAME

__all__ = ["SeqValidator"]


class SeqValidator(Validator):
    """0.3's ``Validator`` for chunk-aware models; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        dataloader: BaseDataLoader.Config = field(
            default_factory=lambda: HuggingFaceTextDataLoader.Config(dataset=VALIDATION_DATASET_NAME, infinite=False)
        )
        """The validation set: the shipped ``seqpp_text_validation`` by default (0.3's is C4's, on the Hub)."""

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, model_parts: list[nn.Module]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """0.3's, without its per-document ``positions`` and with document ids for block-causal flavors.

        Args:
            input_dict: the dataloader's tensors of a batch (a microbatch under pipeline parallelism),
                ``input`` (B, L) token ids among them.
            labels: (B, L) labels.
            model_parts: this rank's model chunks; the first one's config says whether the flavor is
                block-causal.

        Returns:
            0.3's (inputs, labels, extra keyword arguments); for a block-causal flavor the keyword
            arguments hold (B, L) document ids as ``attention_masks``.
        """
        input_dict = {k: v for k, v in input_dict.items() if k != "positions"}
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels, model_parts)
        if getattr(model_parts[0].config, "block_causal", False):
            extra["attention_masks"] = document_ids(inputs, self.tokenizer.eos_id)
        return inputs, labels, extra
