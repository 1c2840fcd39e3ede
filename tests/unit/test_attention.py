"""Chunk-aware attention in one process: units through a KV context equal the full sequence."""

import contextlib
import weakref

import pytest
import torch
from torchtitan.models.llama3 import Transformer

from bottom_right import BottomRightCpuKernel
from harness import TOL, init_test_weights, model_args
from mutations import MutationContext, patches
from torchtitan_seq.attention import bind_kv_context
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.runtime.kv_context import KVContext, Phase, Unit
from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer

# torch's CPU kernel (causal masks aligned top-left: the prefix in calls apart) and one that aligns them
# bottom-right (flash-attn's one-call path, on the CPU)
KERNELS = {"top-left": lambda: select_kernel(torch.device("cpu")), "bottom-right": BottomRightCpuKernel}


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


def _run_units(seq, tokens, weight, lengths, kernel=None) -> torch.Tensor:
    """Forward the units in order through a fresh KV context, backward last unit first."""
    context = KVContext(lengths)
    bind_kv_context(seq, context, kernel or select_kernel(torch.device("cpu")))
    units = [Unit(0, j, sum(lengths[:j]), n, len(lengths)) for j, n in enumerate(lengths)]
    outs = []
    for u in units:
        with context.running(u):
            outs.append(seq(tokens[:, u.offset : u.offset + u.length]))
    for u in reversed(units):  # last subsequence first
        with context.backward(u):
            (outs[u.index].float() * weight[:, u.offset : u.offset + u.length]).sum().backward()
    assert len(context) == 0  # nothing kept once every unit's backward ran
    return torch.cat(outs, 1)


def test_outside_a_unit_it_is_llama3():
    seq, ref = _models()
    bind_kv_context(seq, KVContext(), select_kernel(torch.device("cpu")))
    tokens = torch.randint(0, 64, (2, 24))
    assert torch.equal(seq(tokens), ref(tokens))


@pytest.mark.parametrize("aligned", list(KERNELS))
@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [11, 7, 4, 2]])
def test_units_equal_full_sequence(lengths, aligned):
    seq, ref = _models()
    tokens = torch.randint(0, 64, (2, 24))
    weight = torch.randn(2, 24, 64)  # a loss that weighs every logit differently
    ref_out = ref(tokens)
    (ref_out * weight).sum().backward()
    out = _run_units(seq, tokens, weight, lengths, KERNELS[aligned]())
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


def test_the_context_names_each_phase():
    """FORWARD inside ``running``; inside ``backward`` a forward is a RECOMPUTE and the backward
    BACKWARD; no phase outside a unit; one unit at a time, a refused one changing nothing."""
    context, u = KVContext(), Unit(0, 0, 0, 4, 1)
    assert context.phase(forward=True) is None and context.phase(forward=False) is None
    with context.running(u):
        assert context.unit == u and context.phase(forward=True) is Phase.FORWARD
        with pytest.raises(RuntimeError, match="started while"):
            with context.backward(u):
                pass
    with context.backward(u):
        assert context.unit == u
        assert context.phase(forward=True) is Phase.RECOMPUTE and context.phase(forward=False) is Phase.BACKWARD
    assert context.unit is None and context.phase(forward=True) is None


@pytest.mark.parametrize("aligned", list(KERNELS))
def test_attention_runs_in_the_phase_the_context_gives(aligned):
    """Under activation checkpointing the op asks the context for its phase: each unit's forward,
    then per unit, last first, the recomputation and the backward."""
    from torch.utils.checkpoint import checkpoint

    from torchtitan_seq.attention import SequenceAttention

    class Recording(KVContext):
        def phase(self, *, forward: bool) -> Phase | None:
            self.seen.append(super().phase(forward=forward))
            return self.seen[-1]

    context, layer = Recording([4, 4]), SequenceAttention(0)
    context.seen = []
    layer.bind(context, KERNELS[aligned]())
    units = [Unit(0, j, 4 * j, 4, 2) for j in range(2)]
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    outs = []
    for u in units:
        part = slice(u.offset, u.offset + u.length)
        with context.running(u):
            outs.append(checkpoint(layer, q[:, :, part], k[:, :, part], v[:, :, part], use_reentrant=False))
    for u in reversed(units):
        with context.backward(u):
            outs[u.index].sum().backward()
    assert context.seen == [Phase.FORWARD] * 2 + [Phase.RECOMPUTE, Phase.BACKWARD] * 2
    assert len(context) == 0


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
    whole = [_relative(whole_out, exact)] + [
        _relative(p.grad, q.grad) for p, q in zip(whole.parameters(), ref.parameters())
    ]
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


class CountingKernel:
    """A kernel that counts its forward and backward calls per unit (``unit``: set by the test)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.bottom_right = kernel, kernel.bottom_right
        self.unit: int | None = None
        self.calls: dict[tuple[str, int], int] = {}

    def _count(self, kind: str) -> None:
        self.calls[kind, self.unit] = self.calls.get((kind, self.unit), 0) + 1

    def forward(self, *args):
        self._count("forward")
        return self.kernel.forward(*args)

    def backward(self, *args):
        self._count("backward")
        return self.kernel.backward(*args)


def _units_of_one_layer(kernel, lengths: list[int], ids: torch.Tensor | None):
    """One attention layer run as units over a (5, 4 heads, S, 8) q and (5, 2, S, 8) k, v
    (GQA), through a KV context, against SDPA over the whole sequence with the dense
    (document) mask: the largest relative error of the output and of dq, dk, dv."""
    import torch.nn.functional as F

    from torchtitan_seq.attention import SequenceAttention
    from torchtitan_seq.runtime.documents import Documents, document_mask

    seq_len = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(5, h, seq_len, 8, generator=g, dtype=torch.float64).float().requires_grad_() for h in (4, 2, 2)
    )
    weight = torch.randn(5, 4, seq_len, 8, generator=g)
    mask = document_mask(ids) if ids is not None else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))

    context = KVContext(lengths)
    context.documents = [Documents.from_ids(ids)] if ids is not None else None
    layer = SequenceAttention(0)
    layer.bind(context, kernel)
    units = [Unit(0, j, sum(lengths[:j]), n, len(lengths)) for j, n in enumerate(lengths)]
    outs = {}
    for u in units:
        kernel.unit = u.index
        part = slice(u.offset, u.offset + u.length)
        with context.running(u):
            outs[u.index] = layer(q[:, :, part], k[:, :, part], v[:, :, part], enable_gqa=True)
    for u in reversed(units):
        kernel.unit = u.index
        with context.backward(u):
            (outs[u.index] * weight[:, :, u.offset : u.offset + u.length]).sum().backward()
    assert len(context) == 0
    out = torch.cat([outs[u.index] for u in units], 2)
    return max(_relative(a, b) for a, b in zip((out, q.grad, k.grad, v.grad), (ref, *ref_grads)))


@pytest.mark.parametrize("aligned", list(KERNELS))
@pytest.mark.parametrize("lengths", [[8, 8, 8, 8], [11, 7, 9, 5]])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "block-causal"])
def test_kernel_calls_per_unit(aligned, lengths, packed):
    """Exact against the whole sequence, in the calls of the issue: per unit j, without
    documents, one call forward and one backward with a bottom-right kernel, with a top-left
    one two for j > 0 (prefix unmasked, diagonal causal) and one for j = 0; the last unit two
    with either (no later unit reads its keys, so the slab does not hold them). With documents,
    per batch row: one causal call per document piece in the unit, plus (where two) one unmasked
    call where the document continuing into the unit started before it."""
    from harness import EOS, packed_tokens
    from torchtitan_seq.runtime.documents import Documents, document_ids

    ids = document_ids(packed_tokens(5, 32, torch.Generator().manual_seed(0)), EOS) if packed else None
    kernel = CountingKernel(KERNELS[aligned]())
    assert _units_of_one_layer(kernel, lengths, ids) <= TOL
    docs = Documents.from_ids(ids) if packed else None
    for j, n in enumerate(lengths):
        s, two = sum(lengths[:j]), aligned == "top-left" or j == len(lengths) - 1
        if docs is None:
            expected = 1 + (two and j > 0)
        else:
            expected = sum(len(docs.pieces(b, s, s + n)) + (two and docs.start_of(b, s) < s) for b in range(5))
        assert kernel.calls["forward", j] == kernel.calls["backward", j] == expected, (j, kernel.calls)


def test_a_slab_is_the_one_copy_of_kv_and_lives_until_the_first_units_backward():
    """Units write their K/V into one slab per (microbatch, layer), with room for the keys later
    units read (all but the last unit's); their attention saves views of it (no K/V of its own;
    the last unit's are its own), and the slab goes with the microbatch's last backward on the
    stage (its first unit's)."""
    from torchtitan_seq.attention import SequenceAttention

    context, layer = KVContext([4, 4, 4]), SequenceAttention(0)
    layer.bind(context, select_kernel(torch.device("cpu")))
    units = [Unit(0, j, 4 * j, 4, 3) for j in range(3)]
    q = [torch.randn(1, 2, 4, 2, requires_grad=True) for _ in units]
    k, v = ([torch.randn(1, 1, 4, 2, requires_grad=True) for _ in units] for _ in range(2))
    outs, saved = [], []
    # (the hook runs only inside the block; ``saved`` is deleted after it)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):  # noqa: F821
        for u in units:
            with context.running(u):
                outs.append(layer(q[u.index], k[u.index], v[u.index], enable_gqa=True))
    slab = context._slabs[0][0]
    assert slab.k.shape == (1, 1, 8, 2) and torch.equal(slab.k, torch.cat([t.detach() for t in k[:2]], 2))
    storages = {t.untyped_storage().data_ptr() for t in saved}
    assert slab.k.untyped_storage().data_ptr() in storages and slab.v.untyped_storage().data_ptr() in storages
    mine = {t.untyped_storage().data_ptr() for t in k + v}
    assert mine & storages == {k[2].untyped_storage().data_ptr(), v[2].untyped_storage().data_ptr()}
    kept = weakref.ref(slab.k)
    del slab, saved
    for u in reversed(units):
        assert len(context) == 1 and kept() is not None
        with context.backward(u):
            outs.pop().sum().backward()
    assert len(context) == 0 and kept() is None


def test_eager_units_run_the_autograd_function_and_dispatch_modes_the_custom_op():
    """In eager mode a bound layer runs UnitAttention (no custom-op dispatch on the host, #40); under a
    dispatch mode (selective checkpointing's cache) the custom op, which such a mode sees as one op;
    the same output either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan_seq.attention import SequenceAttention

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 4, requires_grad=True) for h in (4, 2, 2))
    outs = {}
    for mode in ("eager", "dispatch mode"):
        layer, context = SequenceAttention(0), KVContext([8])
        layer.bind(context, select_kernel(torch.device("cpu")))
        with context.running(Unit(0, 0, 0, 8, 1)), PassThrough() if mode != "eager" else contextlib.nullcontext():
            outs[mode] = layer(q, k, v)
    assert type(outs["eager"].grad_fn).__name__ == "UnitAttentionBackward"
    assert "unit_attention" in type(outs["dispatch mode"].grad_fn).__name__
    assert torch.equal(outs["eager"], outs["dispatch mode"])
