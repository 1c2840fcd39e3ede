"""Every family's model, as a sequence schedule runs it under torchtitan 0.2.2, initialises every parameter:
built on the meta device and given memory full of NaN (what ``to_empty`` may hand over), as the trainer
builds it, its ``init_weights`` leaves no parameter or buffer non-finite. torchtitan 0.2.2's own router
leaves its gate's bias (gpt-oss's) as it finds it."""

from __future__ import annotations

import copy

import pytest
import torch

from harness import TITAN

pytestmark = [
    pytest.mark.skipif(TITAN.version != "0.2.2", reason="torchtitan 0.2.2's train specs"),
    pytest.mark.slow,  # gpt-oss's 201088-token vocabulary: some 30 s to initialise
]

FLAVORS = {"llama3": "debugmodel", "qwen3": "debugmodel_moe", "deepseek_v3": "debugmodel", "gpt_oss": "debugmodel"}


@pytest.mark.parametrize("family", FLAVORS)
def test_init_weights_leaves_nothing_as_it_found_it(family):
    from torchtitan_seq.titan.v022.models.train_specs import sequence_train_spec

    spec = sequence_train_spec(family)
    args = copy.deepcopy(spec.model_args[FLAVORS[family]])
    args.moe_impl = "standard"  # the trainer sets it (update_from_config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    with torch.no_grad():  # as torchtitan's trainer calls it
        model.init_weights(buffer_device=torch.device("cpu"))
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if not t.isfinite().all()]
    assert not left, left
