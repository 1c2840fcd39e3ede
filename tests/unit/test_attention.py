"""Chunk-aware attention in one process: units through a KV context equal the full sequence."""

import weakref

import pytest
import torch
from exactness import TOL, init_test_weights, model_args
from mutations import MutationContext, patches
from torchtitan.models.llama3 import Transformer

from torchtitan_seq.attention import bind_kv_context, select_kernel
from torchtitan_seq.kv_context import KVContext, Unit
from torchtitan_seq.models.llama3_seq import SeqTransformer


def _models(seq_len=24):
    torch.manual_seed(0)
    seq = SeqTransformer(model_args(seq_len))
    init_test_weights(seq)
    ref = Transformer(model_args(seq_len))
    ref.load_state_dict(seq.state_dict())
    return seq, ref


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the largest magnitude of the reference ``b``."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def _run_units(seq, tokens, weight, lengths, dtype=torch.float32) -> torch.Tensor:
    """Forward the units in order through a fresh KV context, backward last unit first."""
    context = KVContext()
    bind_kv_context(seq, context, select_kernel(torch.device("cpu")))
    units = [Unit(0, j, sum(lengths[:j]), n, len(lengths)) for j, n in enumerate(lengths)]
    outs = []
    for u in units:
        with context.running(u):
            outs.append(seq(tokens[:, u.offset:u.offset + u.length]))
    for u in reversed(units):  # last subsequence first
        with context.backward(u):
            (outs[u.index].float() * weight[:, u.offset:u.offset + u.length]).sum().backward()
    assert len(context) == 0  # nothing kept once every unit's backward ran
    return torch.cat(outs, 1)


def test_outside_a_unit_it_is_llama3():
    seq, ref = _models()
    bind_kv_context(seq, KVContext(), select_kernel(torch.device("cpu")))
    tokens = torch.randint(0, 64, (2, 24))
    assert torch.equal(seq(tokens), ref(tokens))


@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [11, 7, 4, 2]])
def test_units_equal_full_sequence(lengths):
    seq, ref = _models()
    tokens = torch.randint(0, 64, (2, 24))
    weight = torch.randn(2, 24, 64)  # a loss that weighs every logit differently
    ref_out = ref(tokens)
    (ref_out * weight).sum().backward()
    out = _run_units(seq, tokens, weight, lengths)
    assert _relative(out, ref_out) <= TOL
    for (name, p), q in zip(seq.named_parameters(), ref.parameters()):
        assert _relative(p.grad, q.grad) <= TOL, name


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


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    """Parameters in bf16, as torchtitan's mixed precision computes; buffers (RoPE's complex
    frequencies) untouched, as ``model.to(torch.bfloat16)`` would drop their imaginary part."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def _bf16_errors(mutation: str | None) -> tuple[float, float]:
    """bf16 against the fp32 whole sequence, as (units through the KV context, whole sequence
    in bf16): the largest relative error over the output and every parameter's gradient."""
    import copy

    seq, ref = _models()
    tokens = torch.randint(0, 64, (2, 24))
    weight = torch.randn(2, 24, 64)
    exact = ref(tokens)
    (exact * weight).sum().backward()

    whole = _bf16(copy.deepcopy(ref))
    whole.zero_grad(set_to_none=True)
    whole_out = whole(tokens)
    (whole_out.float() * weight).sum().backward()

    mutated = patches(mutation, MutationContext(schedule="Seq1F1B", units_per_step=4, tp_group=None))
    for p in mutated:
        p.start()
    try:
        out = _run_units(_bf16(seq), tokens, weight, [11, 7, 4, 2])
    finally:
        for p in mutated:
            p.stop()
    units = [_relative(out, exact)] + [_relative(p.grad, q.grad) for p, q in zip(seq.parameters(), ref.parameters())]
    whole = [_relative(whole_out, exact)] + [_relative(p.grad, q.grad) for p, q in zip(whole.parameters(), ref.parameters())]
    assert all(p.grad.dtype == torch.bfloat16 for p in seq.parameters())
    return max(units), max(whole)


BF16_BOUND = 2.0  # units may be off by at most twice the whole sequence's bf16 error


def test_bf16_units_lose_no_more_than_the_whole_sequence_in_bf16():
    """bf16 compute, as torchtitan's mixed precision runs on GPUs: against the fp32 result,
    units through the KV context (K/V kept in bf16, blocks merged in fp32) are no further off
    than the whole sequence in bf16, relative to each tensor's own scale."""
    units, whole = _bf16_errors(None)
    assert units <= BF16_BOUND * whole, (units, whole)


@pytest.mark.parametrize("mutation", ["prefix_dk_dropped", "prefix_dq_dropped", "rope_offset"])
def test_bf16_bound_catches_the_attention_mutations(mutation):
    units, whole = _bf16_errors(mutation)
    assert units > 5 * BF16_BOUND * whole, (mutation, units, whole)


def test_side_buffers_do_not_keep_their_units_kv():
    """A unit's own record keeps its gradient side buffers, not its K/V: once the last unit
    that read block 0 ran backward, block 0's K (a copy, as under compile) is freed, though
    unit 0's backward is still to come."""
    context = KVContext()
    units = [Unit(0, j, 4 * j, 4, 2) for j in range(2)]
    for u in units:
        with context.running(u):
            prefix, _ = context.append(0, torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2), copy=True)
    kept = weakref.ref(prefix[0].k)
    del prefix
    with context.backward(units[1]):
        pass
    assert kept() is None
