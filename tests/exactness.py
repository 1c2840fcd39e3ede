"""Multi-process exactness harness: a sequence schedule against the full-sequence reference.

Each variant builds a tiny Llama 3 (GQA, fp32), computes the reference loss and
gradients on the whole sequence in one process, then trains the same weights
under a schedule on ``pp`` gloo ranks and reports the largest differences.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = 1e-5  # fp32 round-off for this model size


@dataclass
class Variant:
    name: str
    schedule: str = "Seq1F1B"
    pp: int = 2
    k: int = 4
    partition: str = "even"
    split_backward: bool = False
    microbatches: int = 2
    seq_len: int = 32
    mean_loss: bool = False  # negative control: per-unit mean, scale_grads=True
    chunk_order_backward: bool = False  # negative control: bypass rule 2
    no_kv_grad: bool = False  # negative control: drop the K/V side buffers
    steps: int = 1  # steps run on the same batch; the last one is compared


def model_args(seq_len: int):
    from torchtitan.models.llama3 import TransformerModelArgs

    return TransformerModelArgs(
        dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
        max_seq_len=seq_len, rope_theta=10000,
    )


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _run_variant(v: Variant, rank: int) -> dict:
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.pipeline_parallel import (
        generate_llm_fqn_per_model_part,
        pipeline_module_split,
    )

    from torchtitan_seq import kv_context, schedules
    from torchtitan_seq.loss import TokenNormalizedLoss
    from torchtitan_seq.memory import ActivationMemory
    from torchtitan_seq.model import SeqTransformer
    from torchtitan_seq.partition import UnitCost, partition_sequence
    from torchtitan_seq.stage import SequencePipelineStage

    args = model_args(v.seq_len)
    torch.manual_seed(0)
    whole = SeqTransformer(args)
    with torch.no_grad():
        whole.init_weights()
    batch = 2 * v.microbatches
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (batch, v.seq_len), generator=g)
    labels = torch.randint(0, args.vocab_size, (batch, v.seq_len), generator=g)

    ref_loss = cross_entropy_loss(whole(tokens), labels) / labels.numel()
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref_grads = {n: p.grad.clone() for n, p in whole.named_parameters()}
    whole.zero_grad(set_to_none=True)

    mesh = init_device_mesh("cpu", (v.pp,), mesh_dim_names=("pp",))
    names = generate_llm_fqn_per_model_part(v.pp, args.n_layers, 1, 1)
    _, chunks = pipeline_module_split(whole, mesh, "1F1B", torch.device("cpu"), names)
    chunk = chunks[0]
    lengths = partition_sequence(
        v.seq_len, v.k, v.partition, cost=UnitCost.from_model_args(args)
    )
    stage = SequencePipelineStage(
        chunk, rank, v.pp, torch.device("cpu"), lengths=lengths, group=mesh.get_group()
    )
    if v.mean_loss:
        loss_fn, scale = (lambda p, t: cross_entropy_loss(p, t) / t.numel()), True
    else:
        loss_fn = TokenNormalizedLoss(cross_entropy_loss)
        loss_fn.denominator = labels.numel()
        scale = False
    patches = []
    if v.chunk_order_backward:
        def chunk_order(p, n, k, split_backward=False):
            order = schedules.seq1f1b_actions(p, n, k, split_backward=split_backward)
            return {r: _chunk_order_backwards(acts) for r, acts in order.items()}
        patches.append(mock.patch.object(schedules.ScheduleSeq1F1B, "actions_fn", staticmethod(chunk_order)))
        patches.append(mock.patch.object(schedules, "validate_unit_order", lambda *a: None))
    if v.no_kv_grad:
        patches.append(mock.patch.object(kv_context.KVBlock, "accumulate", lambda self, gk, gv: None))
    for p in patches:
        p.start()
    memory = ActivationMemory()
    activations_left, peaks = [], []
    try:
        sched = schedules.SEQUENCE_SCHEDULES[v.schedule](
            stage, v.microbatches, loss_fn, split_backward=v.split_backward, scale_grads=scale
        )
        for _ in range(v.steps):
            chunk.zero_grad(set_to_none=True)
            losses = [] if stage.is_last else None
            with memory.track():
                sched.step(*((tokens,) if stage.is_first else ()),
                           target=labels if stage.is_last else None, losses=losses)
            activations_left.append(memory.current)
            peaks.append(memory.peak)
    finally:
        for p in patches:
            p.stop()
    grad_diff = max(
        float((p.grad - ref_grads[n]).abs().max()) if p.grad is not None else float("inf")
        for n, p in chunk.named_parameters()
    )
    out = {
        "grad_diff": grad_diff,
        "kv_left": len(stage.kv_context),
        "activations_left": max(activations_left),
        "peaks": peaks,
    }
    if stage.is_last:
        out["loss_diff"] = abs(float(sum(losses)) - ref_loss.item())
        out["n_losses"] = len(losses)
    return out


def _chunk_order_backwards(actions):
    """The same actions with every backward kind run in subsequence order (rule 2 broken)."""
    from torchtitan_seq.ordering import F

    queues = {}
    for a in actions:
        if a.computation_type != F:
            queues.setdefault(a.computation_type, []).append(a.microbatch_index)
    queues = {kind: iter(sorted(ids)) for kind, ids in queues.items()}
    return [
        a if a.computation_type == F else a._replace(microbatch_index=next(queues[a.computation_type]))
        for a in actions
    ]


def _worker(rank: int, world: int, port: int, variants: list[Variant], out_dir: str) -> None:
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = []
    for v in variants:
        try:
            results.append(_run_variant(v, rank))
        except Exception:  # reported, not raised: the peers must reach the barrier
            results.append({"error": traceback.format_exc()[-3000:]})
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def run_variants(variants: list[Variant], tmp_path) -> list[dict]:
    """Run ``variants`` (all with the same pp) and merge the per-rank reports."""
    import json

    pp = variants[0].pp
    assert all(v.pp == pp for v in variants)
    mp.spawn(_worker, args=(pp, _free_port(), variants, str(tmp_path)), nprocs=pp, join=True)
    per_rank = [json.load(open(os.path.join(tmp_path, f"rank{r}.json"))) for r in range(pp)]
    merged = []
    for i, v in enumerate(variants):
        recs = [per_rank[r][i] for r in range(pp)]
        errors = [r["error"] for r in recs if "error" in r]
        merged.append({
            "name": v.name,
            "error": errors[0] if errors else None,
            "grad_diff": max((r.get("grad_diff", float("inf")) for r in recs), default=float("inf")),
            "loss_diff": recs[-1].get("loss_diff", float("inf")),
            "kv_left": sum(r.get("kv_left", 0) for r in recs),
            "activations_left": max(r.get("activations_left", 0) for r in recs),
            "peaks": [r.get("peaks") for r in recs],
            "n_losses": recs[-1].get("n_losses"),
        })
    return merged
