"""Chunk-aware attention in one process: units through a KV context equal the full sequence."""

import pytest
import torch
from exactness import model_args
from torchtitan.models.llama3 import Transformer

from torchtitan_seq.attention import select_kernel
from torchtitan_seq.kv_context import KVContext, Unit
from torchtitan_seq.model import SeqTransformer, bind_kv_context


def _models(seq_len=24):
    torch.manual_seed(0)
    seq = SeqTransformer(model_args(seq_len))
    with torch.no_grad():
        seq.init_weights()
    ref = Transformer(model_args(seq_len))
    ref.load_state_dict(seq.state_dict())
    return seq, ref


def test_outside_a_unit_it_is_llama3():
    seq, ref = _models()
    bind_kv_context(seq, KVContext(), select_kernel(torch.device("cpu")))
    tokens = torch.randint(0, 64, (2, 24))
    assert torch.equal(seq(tokens), ref(tokens))


@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [11, 7, 4, 2]])
def test_units_equal_full_sequence(lengths):
    seq, ref = _models()
    context = KVContext()
    bind_kv_context(seq, context, select_kernel(torch.device("cpu")))
    tokens = torch.randint(0, 64, (2, 24))
    weight = torch.randn(2, 24, 64)  # a loss that weighs every logit differently

    (ref(tokens) * weight).sum().backward()
    units = [Unit(0, j, sum(lengths[:j]), n, len(lengths)) for j, n in enumerate(lengths)]
    outs = []
    for u in units:
        with context.running(u):
            outs.append(seq(tokens[:, u.offset:u.offset + u.length]))
    for u in reversed(units):  # last subsequence first
        with context.backward(u):
            (outs[u.index] * weight[:, u.offset:u.offset + u.length]).sum().backward()
    assert len(context) == 0  # nothing kept once every unit's backward ran

    ref_out = ref(tokens)
    torch.testing.assert_close(torch.cat(outs, 1), ref_out, rtol=0, atol=1e-5)
    for (name, p), q in zip(seq.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5, msg=name)


def test_forward_out_of_order_is_refused():
    seq, _ = _models()
    context = KVContext()
    bind_kv_context(seq, context, select_kernel(torch.device("cpu")))
    tokens = torch.randint(0, 64, (1, 8))
    with pytest.raises(RuntimeError, match="subsequence order"):
        with context.running(Unit(0, 1, 8, 8, 3)):
            seq(tokens)


def test_flash_backend_needs_cuda_and_flash_attn():
    with pytest.raises(ValueError, match="attention_backend = 'flash'"):
        select_kernel(torch.device("cpu"), "flash")
    with pytest.raises(ValueError, match="attention_backend = 'bogus'"):
        select_kernel(torch.device("cpu"), "bogus")


def test_model_without_chunk_aware_attention_is_refused():
    _, ref = _models()
    with pytest.raises(TypeError, match="llama3_seq"):
        bind_kv_context(ref, KVContext(), None)


def test_bf16_units_lose_no_more_than_the_whole_sequence_in_bf16():
    """bf16 compute, as torchtitan's mixed precision runs on GPUs: against the fp32 result,
    units through the KV context (K/V kept in bf16, blocks merged in fp32) are no further off
    than the whole sequence in bf16."""
    import copy

    seq, ref = _models()
    tokens = torch.randint(0, 64, (2, 24))
    weight = torch.randn(2, 24, 64)
    exact = ref(tokens).detach()
    (ref(tokens) * weight).sum().backward()
    exact_grads = [p.grad.clone() for p in ref.parameters()]

    whole = copy.deepcopy(ref).to(torch.bfloat16)
    whole.zero_grad(set_to_none=True)
    whole_out = whole(tokens)
    (whole_out.float() * weight).sum().backward()

    seq = seq.to(torch.bfloat16)
    context = KVContext()
    bind_kv_context(seq, context, select_kernel(torch.device("cpu")))
    lengths = [11, 7, 4, 2]
    units = [Unit(0, j, sum(lengths[:j]), n, len(lengths)) for j, n in enumerate(lengths)]
    outs = []
    for u in units:
        with context.running(u):
            outs.append(seq(tokens[:, u.offset:u.offset + u.length]))
    for u in reversed(units):
        with context.backward(u):
            (outs[u.index].float() * weight[:, u.offset:u.offset + u.length]).sum().backward()

    def off(a, b):
        return float((a.float() - b).abs().max())

    assert off(torch.cat(outs, 1), exact) <= 2 * off(whole_out, exact) + 1e-3
    for p, w, g in zip(seq.parameters(), whole.parameters(), exact_grads):
        assert p.grad.dtype == torch.bfloat16
        assert off(p.grad, g) <= 2 * off(w.grad, g) + 1e-3
