"""No host read of a tensor on the unit path: a step of every sequence schedule, causal and with packed
documents, with every Python-level way to read a tensor on the host (a device sync where it lies on a
GPU) instrumented, and none called while a unit runs.

On the CPU no read syncs anything, so the test cannot tell a device tensor from a host one: it counts
every read of any tensor while a stage's KV context runs a unit (forward, recompute or backward),
which is stricter than a GPU needs (a read of a tensor that lives on the host would be allowed there).
Reads before the units (the step splitting the batch, the documents' starts, once per step) are not
counted. The whole-sequence document path (torch's schedules) reads the ids once per batch. The
exactness harness steps every variant under the same instrument (host_reads.py): with CP, TP,
FSDP, activation checkpointing, compile and both kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from host_reads import reads_during_units
from torchtitan_seq.runtime.documents import document_ids
from torchtitan_seq.runtime.kv_context import KVContext, Unit

EOS, VOCAB, SEQ_LEN = 3, 64, 32


def _schedule(name: str, k: int, block_causal: bool):
    """A step of schedule ``name`` on this rank of the process group's pipeline over a 4-layer
    Llama 3, and the rank's stages."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    from torchtitan.models.llama3 import TransformerModelArgs

    from torchtitan_seq.runtime.loss import TokenNormalizedLoss
    from torchtitan_seq.runtime.partition import partition_sequence
    from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
    from torchtitan_seq.schedules.stage import SequencePipelineStage
    from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer
    from torchtitan_seq.titan.v022.pipeline import split_model

    cls = SEQUENCE_SCHEDULES[name]
    args = TransformerModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    model = SeqTransformer(args)
    p = dist.get_world_size()
    mesh = init_device_mesh("cpu", (p,), mesh_dim_names=("pp",))
    cpu, num_stages = torch.device("cpu"), p * cls.stages_per_rank
    names = generate_llm_fqn_per_model_part(num_stages // cls.parameter_copies, args.n_layers, 1, 1)
    lengths, group = partition_sequence(SEQ_LEN, k, "even"), mesh.get_group()
    stages = [
        SequencePipelineStage(chunk, i, num_stages, cpu, lengths=lengths, chain_length=n, group=group)
        for i, n, chunk in split_model(model, mesh, name, cpu, names)
    ]
    loss_fn = TokenNormalizedLoss(cross_entropy_loss)
    schedule = cls(stages if cls.stages_per_rank > 1 else stages[0], 2, loss_fn)
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(4, VOCAB, (2, SEQ_LEN), generator=g) for _ in range(2))
    tokens[:, [5, 13, 20]] = EOS  # documents that continue across units
    masks = document_ids(tokens, EOS) if block_causal else None

    def step() -> None:
        with loss_fn.normalized_by(labels.numel()):
            schedule.step(tokens, target=labels, losses=[], attention_masks=masks)

    return step, stages


def _reads_of_steps(rank: int, world: int, store_path: str, out: str) -> None:
    """On each rank of a gloo group of ``world``: a step of every schedule that fits, causal and with
    documents, the reads during the units of the second step (the first infers shapes) written to ``out``."""
    # Forked from a process whose intra-op thread pool may have run: OpenMP's pool does not survive a
    # fork (a parallel region in the child hangs, seen with torch 2.14's build), so one thread.
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    reads = {}
    try:
        for name in ("BSIPipe", "Chimera") if world == 2 else ("Seq1F1B", "TeraPipe", "InterleavedSeq1F1B"):
            for block_causal in (False, True):
                step, stages = _schedule(name, 4, block_causal)
                step()
                with reads_during_units([stage.kv_context for stage in stages]) as seen:
                    step()
                assert any(p.grad is not None for s in stages for p in s.submod.parameters())  # it ran
                reads[f"{name}, documents={block_causal}"] = seen[:1]
    finally:
        dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(reads))


@pytest.mark.parametrize("world", [1, 2], ids=["one-rank-schedules", "paired-schedules"])
def test_no_tensor_is_read_on_the_host_during_the_units(tmp_path, world):
    """Seq1F1B, TeraPipe and InterleavedSeq1F1B on one rank (p = 1; InterleavedSeq1F1B's two stages
    both there); BSIPipe and Chimera, which pair ranks, on two."""
    out = str(tmp_path / "reads")
    mp.start_processes(_reads_of_steps, (world, str(tmp_path / "store"), out), nprocs=world, start_method="fork")
    for rank in range(world):
        reads = json.loads(Path(f"{out}.{rank}").read_text())
        assert len(reads) == 4 if world == 2 else 6
        bad = {run: first for run, first in reads.items() if first}
        assert not bad, f"rank {rank}: host reads of a tensor during the units: {bad}"


def test_the_instrument_sees_a_read():
    """A read inside a unit is counted (the instrument works), one outside is not."""
    context = KVContext([4, 4])
    with reads_during_units([context]) as seen:
        torch.ones(2).tolist()
        assert not seen
        with context.running(Unit(0, 0, 0, 4, 2)):
            bool(torch.ones(()))
    assert [s.split("\n")[0] for s in seen] == ["__bool__"]


def test_document_starts_are_read_once_per_batch(monkeypatch):
    """The whole-sequence document path (torch's schedules) reads a batch's ids on the host once,
    however many layers and backward passes read its documents."""
    from torchtitan_seq.attention.whole_sequence import whole_sequence_attention

    tokens = torch.randint(4, VOCAB, (2, 16))
    tokens[:, 6] = EOS
    ids = document_ids(tokens, EOS)
    calls = []
    original = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **kw: calls.append(1) or original(t, *a, **kw))
    q, k, v = (torch.randn(2, h, 16, 8, requires_grad=True) for h in (4, 2, 2))
    outs = [whole_sequence_attention(q, k, v, ids, None, True, True) for _ in range(3)]  # three layers
    sum(o.sum() for o in outs).backward()
    assert len(calls) == 1
