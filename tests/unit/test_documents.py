"""Packed documents: numbering as torchtitan's document mask, the layout unit attention
reads, and what the KV context keeps."""

import dataclasses

import pytest
import torch

from harness import EOS, init_test_weights, model_args, packed_tokens
from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.runtime.documents import Documents, document_ids, document_mask
from torchtitan_seq.runtime.kv_context import KVContext, Unit


def _tokens(batch: int = 5, seq_len: int = 32) -> torch.Tensor:
    return packed_tokens(batch, seq_len, torch.Generator().manual_seed(0))


def test_document_mask_is_torchtitans():
    from torchtitan.models.attention import get_causal_mask_mod, get_document_mask_mod

    tokens = _tokens()
    documents, causal = get_document_mask_mod(tokens.clone(), EOS), get_causal_mask_mod()
    b, q, k = torch.meshgrid(*(torch.arange(n) for n in (5, 32, 32)), indexing="ij")
    theirs = documents(b, None, q, k) & causal(b, None, q, k)
    assert torch.equal(document_mask(document_ids(tokens, EOS)).squeeze(1), theirs)


@pytest.mark.slow  # flex attention compiles its kernel on the CPU: half a minute
def test_block_causal_flavor_computes_torchtitans_flex_model():
    """Same weights, same packed batch: logits of torchtitan's own Llama 3 with flex
    attention and a block-causal mask (forward only: flex has no CPU backward)."""
    from torchtitan.models.llama3 import Transformer

    from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer, seq_llama3_flavors

    assert {"debugmodel_flex_attn", "debugmodel_varlen_attn", "8B_flex", "8B_varlen"} <= set(seq_llama3_flavors)
    args = dataclasses.replace(model_args(32), attn_type="flex", attn_mask_type="block_causal")
    torch.manual_seed(0)
    ours = SeqTransformer(args)
    init_test_weights(ours)
    theirs = Transformer(args)
    theirs.load_state_dict(ours.state_dict())
    tokens = _tokens(4)
    tokenizer = type("Tokenizer", (), {"eos_id": EOS})()
    with torch.no_grad():
        ours_out = ours(tokens, ours.get_attention_masks(tokens, tokenizer))
        theirs_out = theirs(tokens, theirs.get_attention_masks(tokens, tokenizer))
        causal = ours(tokens)
    scale = theirs_out.abs().max()
    assert (ours_out - theirs_out).abs().max() <= 1e-5 * scale
    assert (ours_out - causal).abs().max() >= 0.1 * scale  # the masks matter in this batch


def test_layout_of_a_packed_microbatch():
    docs = Documents.from_ids(document_ids(_tokens(), EOS))
    assert docs.starts == ((0, 3, 5, 7, 16), (0,), (0, 20), (0, 1, 31), (0,))
    assert docs.pieces(0, 0, 8) == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert docs.pieces(0, 8, 16) == [(0, 8)] and docs.pieces(0, 16, 24) == [(0, 8)]
    assert [docs.start_of(0, p) for p in (2, 8, 16, 31)] == [0, 7, 16, 16]
    assert docs.first_needed(16) == 0  # rows 1, 2 and 4 are still in their first document
    assert Documents.from_ids(document_ids(_tokens()[[0, 3]], EOS)).first_needed(16) == 1


def test_a_unit_reads_only_its_continuing_documents_keys():
    """Per row, a unit's prefix call reads the keys of the document continuing into it, from
    that document's first key, in one call; the K/V of documents that ended stay in the slab
    (one per microbatch and layer, room for the keys of every unit but the last) until the
    microbatch's backward is over."""
    from torchtitan_seq.attention import SequenceAttention
    from torchtitan_seq.attention.kernels import CpuSdpaKernel

    class Recording(CpuSdpaKernel):
        def __init__(self):
            self.prefix_keys: list[list[float]] = []

        def forward(self, q, k, v, causal, scale, band=None):
            if not causal:
                self.prefix_keys.append(k[0, 0, :, 0].tolist())
            return super().forward(q, k, v, causal, scale, band)

    ids = torch.tensor([[0] * 6 + [1] * 10])  # a document starts at 6, in unit 1 of 4 units of 4
    context, kernel, layer = KVContext([4] * 4), Recording(), SequenceAttention(0)
    context.documents = [Documents.from_ids(ids)]
    layer.bind(context, kernel)
    held, reads = [], []
    for j in range(4):
        kv = torch.arange(4.0 * j, 4.0 * j + 4).view(1, 1, 4, 1).expand(1, 1, 4, 2)  # key p holds p
        with context.running(Unit(0, j, 4 * j, 4, 4)):
            layer(torch.randn(1, 1, 4, 2), kv.clone(), kv.clone())
        reads.append(kernel.prefix_keys)
        kernel.prefix_keys = []
        held.append(KVMemory([context]).held())
    assert reads == [[], [[0, 1, 2, 3]], [[6, 7]], [[6, 7, 8, 9, 10, 11]]]
    # K and V of the 12 keys later units read, x 2 dims, fp32, from the first unit on
    assert held == [2 * 12 * 2 * 4] * 4
    context.clear()
    assert KVMemory([context]).held() == 0


@pytest.mark.parametrize("bad", ["length", "batch"])
def test_schedule_rejects_masks_unlike_the_batch(bad):
    from torchtitan_seq.schedules import SequenceSchedule

    sched = SequenceSchedule.__new__(SequenceSchedule)
    sched.num_microbatches, sched.lengths = 2, [8, 8]
    ids = torch.zeros(4, 12 if bad == "length" else 16, dtype=torch.int32)
    if bad == "batch":
        ids = ids[:3]
    with pytest.raises(ValueError, match="attention_masks"):
        sched._split_units(ids, "attention_masks")


def test_whole_sequence_attention_equals_the_dense_document_mask():
    """Unbound (no pipeline, torch's schedules): one causal kernel call per document piece,
    no mask; output and gradients against SDPA with the dense mask, relative to their scale."""
    import torch.nn.functional as F

    from torchtitan_seq.attention import SequenceAttention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, 32, 8, generator=g).requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(5, 4, 32, 8, generator=g)
    ids = document_ids(_tokens(), EOS)
    results = []
    for attend in (
        lambda: SequenceAttention(0)(q, k, v, enable_gqa=True, documents=ids),
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids), enable_gqa=True),
    ):
        out = attend()
        grads = torch.autograd.grad(out, (q, k, v), dout)
        results.append((out, *grads))
    for got, ref in zip(*results):
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (results[0][0] - causal).abs().max() >= 0.1 * causal.abs().max()
