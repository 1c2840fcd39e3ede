"""torchtitan 0.3's model is exact under the sequence schedules: a Seq1F1B step on one gloo rank gives
the loss and every gradient of the whole sequence through 0.3's own model (causal and block-causal)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="torchtitan 0.3's Llama 3 needs torchtitan 0.3")

EOS, SEQ, BATCH = 1, 96, 2


@pytest.fixture
def gloo_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(recipe: str):
    from torchtitan_seq import recipes

    config = getattr(recipes, recipe)()
    config.training.seq_len = SEQ
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    torch.manual_seed(0)
    model = model_config.build()
    model.init_weights(buffer_device=None)
    return model, config.loss.build()


@pytest.mark.parametrize("recipe", ["llama3_debugmodel_seq1f1b", "llama3_debugmodel_block_causal_seq1f1b"])
def test_a_seq1f1b_step_equals_the_whole_sequence(gloo_rank, recipe):
    from torchtitan_seq.runtime.documents import document_ids
    from torchtitan_seq.schedules import ScheduleSeq1F1B
    from torchtitan_seq.schedules.stage import SequencePipelineStage

    model, loss = _model(recipe)
    torch.manual_seed(1)
    tokens, labels = torch.randint(2, 2048, (BATCH, SEQ)), torch.randint(2, 2048, (BATCH, SEQ))
    tokens[:, 20::37] = EOS  # documents end inside units and across their boundaries
    masks = document_ids(tokens, EOS) if model.config.block_causal else None
    tokens_n = torch.tensor(labels.numel())
    ref_loss, _ = loss(model(tokens, attention_masks=masks), labels, tokens_n)
    ref_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    stage = SequencePipelineStage(model, 0, 1, torch.device("cpu"), lengths=[40, 32, 24])
    schedule = ScheduleSeq1F1B(stage, n_microbatches=BATCH, loss_fn=lambda *a, **k: loss(*a, **k)[0])
    losses: list = []
    schedule.step(
        arg_mbs=[(t,) for t in tokens.split(1)],
        kwarg_mbs=[{"attention_masks": m} for m in masks.split(1)] if masks is not None else [{}] * BATCH,
        target_mbs=list(labels.split(1)),
        losses=losses,
        loss_kwargs={"global_valid_tokens": tokens_n},
    )
    assert abs(sum(losses).item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    for name, p in model.named_parameters():
        g = expected[name]
        assert (p.grad - g).abs().max() <= 1e-5 * g.abs().max(), name
