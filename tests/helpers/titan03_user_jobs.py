"""torchtitan 0.3 config functions a user might write beside :mod:`torchtitan_seq.recipes`, for the settings
walk (``--module titan03_user_jobs --config NAME``): settings that 0.3's command line cannot reach."""

from __future__ import annotations

from typing import Any


def llama3_debugmodel_chunked_loss() -> Any:
    """The Llama 3 debug job with 0.3's own models' loss, which runs the output layer chunk by chunk inside
    the loss (``ChunkedLossWrapper``), instead of the recipes' whole-output-layer cross-entropy.

    Returns:
        The job's :class:`~torchtitan_seq.titan.v03.trainer.SeqTrainer` config.
    """
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from torchtitan_seq.recipes import llama3_debugmodel_seq1f1b

    config = llama3_debugmodel_seq1f1b()
    vocab_size = config.model_spec.model.vocab_size
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab_size))
    return config
