"""Multi-process exactness harness: a sequence schedule against the full-sequence reference.

Each variant builds a tiny Llama 3 (GQA, fp32), computes the reference loss and
gradients on the whole sequence in one process, then trains the same weights
under a schedule on ``pp`` gloo ranks (v model chunks each for a multi-stage
schedule, placed as torchtitan places them) and reports the largest differences.
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
    layers: int = 4  # of the tiny model: pp * v stages need enough of them
    ac: str = "none"  # torchtitan activation checkpointing: none, full, selective:<layers|op>
    dp_shard: int = 1  # FSDP2 degree, through torchtitan's parallelize_llama
    tp: int = 1  # tensor-parallel degree, likewise

    @property
    def world(self) -> int:
        return self.pp * self.dp_shard * self.tp

    @property
    def stages_per_rank(self) -> int:
        from torchtitan_seq.schedules import SEQUENCE_SCHEDULES

        return SEQUENCE_SCHEDULES[self.schedule].stages_per_rank
    no_recompute_replay: bool = False  # negative control: recomputation ignores the recorded prefix
    no_pair_combine: bool = False  # negative control (BSIPipe): mirrored copies' gradients not combined
    optimizer_steps: int = 0  # AdamW steps (and BSIPipe copy syncs) after the compared step


def model_args(seq_len: int, n_layers: int = 4):
    from torchtitan.models.llama3 import TransformerModelArgs

    return TransformerModelArgs(
        dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
        max_seq_len=seq_len, rope_theta=10000,
    )


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def dp_rank_of(rank: int, v: Variant) -> int:
    """Data-parallel coordinate of ``rank`` in torchtitan's mesh order (pp, dp_shard, tp)."""
    return rank // v.tp % v.dp_shard


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _pipeline_chunks(whole, args, v: Variant):
    """This rank's chunks of ``whole``, [(stage index, chunk)], parallelised as torchtitan does it."""
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    from torchtitan_seq.cpu_compat import fsdp_for_gloo
    from torchtitan_seq.pipeline import split_model
    from torchtitan_seq.schedules import SEQUENCE_SCHEDULES

    dims = ParallelDims(dp_replicate=1, dp_shard=v.dp_shard, cp=1, tp=v.tp, pp=v.pp, ep=1, etp=1,
                        world_size=v.world)
    dims.build_mesh()
    pp_mesh = dims.get_mesh("pp")
    cls = SEQUENCE_SCHEDULES[v.schedule]
    names = generate_llm_fqn_per_model_part(v.pp * v.stages_per_rank // cls.parameter_copies, args.n_layers, 1, 1)
    # Placed as torchtitan_seq places it inside torchtitan.
    split = split_model(whole, pp_mesh, v.schedule, torch.device("cpu"), names)
    job = JobConfig()
    job.training.seq_len = v.seq_len
    job.parallelism.pipeline_parallel_degree = v.pp
    job.parallelism.data_parallel_shard_degree = v.dp_shard
    job.parallelism.tensor_parallel_degree = v.tp
    job.parallelism.disable_loss_parallel = True
    job.compile.enable = False
    job.training.mixed_precision_param = "float32"  # torchtitan's FSDP default is bf16
    mode, _, option = v.ac.partition(":")
    job.activation_checkpoint.mode = mode
    job.activation_checkpoint.selective_ac_option = option or "2"
    chunks = [(index, chain, parallelize_llama(chunk, dims, job)) for index, chain, chunk in split]
    fsdp_for_gloo([chunk for _, _, chunk in chunks])
    return chunks, pp_mesh, dp_rank_of(dist.get_rank(), v)


def _run_variant(v: Variant, rank: int) -> dict:
    from unittest import mock

    from torchtitan.components.loss import cross_entropy_loss

    from torchtitan_seq import kv_context, schedules
    from torchtitan_seq.loss import TokenNormalizedLoss
    from torchtitan_seq.memory import ActivationMemory
    from torchtitan_seq.model import SeqTransformer
    from torchtitan_seq.partition import UnitCost, partition_sequence
    from torchtitan_seq.stage import SequencePipelineStage

    args = model_args(v.seq_len, v.layers)
    torch.manual_seed(0)
    whole = SeqTransformer(args)
    with torch.no_grad():
        whole.init_weights()
    batch = 2 * v.microbatches
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (batch, v.seq_len), generator=g)
    labels = torch.randint(0, args.vocab_size, (batch, v.seq_len), generator=g)

    logits = whole(tokens)
    ref_loss = cross_entropy_loss(logits, labels) / labels.numel()
    ref_loss.backward()
    # Each data-parallel rank trains on its slice of the batch and reports its share.
    local = slice(None)
    if v.dp_shard > 1:
        n = batch // v.dp_shard
        local = slice(dp_rank_of(rank, v) * n, (dp_rank_of(rank, v) + 1) * n)
    ref_loss = (cross_entropy_loss(logits[local], labels[local]) / labels.numel()).detach()
    ref_grads = {n: p.grad.clone() for n, p in whole.named_parameters()}
    whole.zero_grad(set_to_none=True)

    chunks, pp_mesh, dp_rank = _pipeline_chunks(whole, args, v)
    # Sequence parallelism shards every unit evenly over the TP ranks.
    lengths = partition_sequence(
        v.seq_len, v.k, v.partition, multiple=v.tp, cost=UnitCost.from_model_args(args)
    )
    stages = [
        SequencePipelineStage(
            chunk, index, v.pp * v.stages_per_rank, torch.device("cpu"), lengths=lengths,
            chain_length=chain, group=pp_mesh.get_group(),
        )
        for index, chain, chunk in chunks
    ]
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    if v.mean_loss:
        loss_fn, scale = (lambda p, t: cross_entropy_loss(p, t) / t.numel()), True
    else:
        loss_fn = TokenNormalizedLoss(cross_entropy_loss)
        loss_fn.denominator = labels.numel()
        scale = False
    patches = []
    if v.chunk_order_backward:
        schedule_cls = schedules.SEQUENCE_SCHEDULES[v.schedule]
        actions_fn = schedule_cls.actions_fn

        def chunk_order(*args, **kwargs):
            return {r: _chunk_order_backwards(acts) for r, acts in actions_fn(*args, **kwargs).items()}
        patches.append(mock.patch.object(schedule_cls, "actions_fn", staticmethod(chunk_order)))
        patches.append(mock.patch.object(schedules, "validate_unit_order", lambda *a: None))
    if v.no_recompute_replay:
        recorded = kv_context.KVContext.recorded
        patches.append(mock.patch.object(
            kv_context.KVContext, "recorded", lambda self, layer: ([], recorded(self, layer)[1])))
    if v.no_pair_combine:
        from torchtitan_seq.bidirectional import MirroredCopies

        patches.append(mock.patch.object(MirroredCopies, "combine_gradients", lambda self: None))
    if v.no_kv_grad:
        patches.append(mock.patch.object(kv_context.KVBlock, "accumulate", lambda self, gk, gv: None))
    for p in patches:
        p.start()
    memory = ActivationMemory()
    activations_left, peaks = [], []
    try:
        sched = schedules.SEQUENCE_SCHEDULES[v.schedule](
            stages, v.microbatches, loss_fn, split_backward=v.split_backward, scale_grads=scale
        )
        for _ in range(v.steps):
            for _, _, chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            losses = [] if last else None
            with memory.track():
                sched.step(*((tokens[local],) if first else ()),
                           target=labels[local] if last else None, losses=losses)
            activations_left.append(memory.current)
            peaks.append(memory.peak)
    finally:
        for p in patches:
            p.stop()
    # A BSIPipe chunk's gradient ends on its chain-A copy; the chain-B copy keeps none.
    primary = [(index, chunk) for index, chain, chunk in chunks if index < chain]
    mirror_grads = sum(p.grad is not None for index, chain, chunk in chunks if index >= chain
                       for p in chunk.parameters())
    grad_diff = max(
        float((_full(p.grad) - ref_grads[n.replace("_checkpoint_wrapped_module.", "")]).abs().max())
        if p.grad is not None else float("inf")
        for _, chunk in primary
        for n, p in chunk.named_parameters()
    )
    copies_diff = []
    if v.optimizer_steps:
        params = [p for _, _, chunk in chunks for p in chunk.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2)
        for _ in range(v.optimizer_steps):
            opt.step()
            if hasattr(sched, "sync_copies"):
                sched.sync_copies()
                copies_diff.append(sched.copies.max_difference())
            opt.zero_grad(set_to_none=True)
            sched.step(*((tokens[local],) if first else ()), target=labels[local] if last else None)
    out = {
        "grad_diff": grad_diff,
        "kv_left": sum(len(s.kv_context) for s in stages),
        "activations_left": max(activations_left),
        "peaks": peaks,
        "mirror_grads": mirror_grads,
        "copies_diff": copies_diff,
    }
    # Every last stage holds its units' losses (BSIPipe has two); the pipeline's sum is the loss.
    loss = torch.tensor(float(sum(losses)) if last else 0.0)
    dist.all_reduce(loss, group=pp_mesh.get_group())
    if last:
        out["loss_diff"] = abs(loss.item() - ref_loss.item())
        out["n_losses"] = len(losses)
    return out


def _chunk_order_backwards(actions):
    """The same actions with every backward kind run in subsequence order on each stage (rule 2 broken)."""
    from torchtitan_seq.ordering import F

    queues = {}
    for a in actions:
        if a.computation_type != F:
            queues.setdefault((a.stage_index, a.computation_type), []).append(a.microbatch_index)
    queues = {key: iter(sorted(ids)) for key, ids in queues.items()}
    return [
        a if a.computation_type == F
        else a._replace(microbatch_index=next(queues[a.stage_index, a.computation_type]))
        for a in actions
    ]


def _worker(rank: int, world: int, port: int, variants: list[Variant], out_dir: str) -> None:
    import json

    import torchtitan_seq  # noqa: F401  (CPU compatibility before torchtitan is imported)

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
    """Run ``variants`` (all on the same number of ranks) and merge the per-rank reports."""
    import json

    world = variants[0].world
    assert all(v.world == world for v in variants)
    mp.spawn(_worker, args=(world, _free_port(), variants, str(tmp_path)), nprocs=world, join=True)
    per_rank = [json.load(open(os.path.join(tmp_path, f"rank{r}.json"))) for r in range(world)]
    merged = []
    for i, v in enumerate(variants):
        recs = [per_rank[r][i] for r in range(world)]
        errors = [r["error"] for r in recs if "error" in r]
        merged.append({
            "name": v.name,
            "error": errors[0] if errors else None,
            "grad_diff": max((r.get("grad_diff", float("inf")) for r in recs), default=float("inf")),
            "loss_diff": max((r["loss_diff"] for r in recs if "loss_diff" in r), default=float("inf")),
            "kv_left": sum(r.get("kv_left", 0) for r in recs),
            "activations_left": max(r.get("activations_left", 0) for r in recs),
            "peaks": [r.get("peaks") for r in recs],
            "n_losses": next((r["n_losses"] for r in recs if "n_losses" in r), None),
            "mirror_grads": sum(r.get("mirror_grads", 0) for r in recs),
            "copies_diff": [max(d) for d in zip(*(r.get("copies_diff", []) for r in recs))],
        })
    return merged


def assert_exact(r: dict, n_losses: int | None = None, activations_left: bool = False) -> None:
    """A variant matched the reference: loss, every gradient, an empty KV context after the step.

    Unless ``activations_left``, no saved activation may outlive the step either.
    """
    assert r["error"] is None, f"{r['name']}:\n{r['error']}"
    assert r["loss_diff"] <= TOL and r["grad_diff"] <= TOL, r
    assert r["kv_left"] == 0, r
    assert activations_left or r["activations_left"] == 0, r
    if n_losses is not None:
        assert r["n_losses"] == n_losses, r  # one loss per microbatch, as torch's schedules


def assert_breaks_exactness(r: dict, margin: float = 100) -> None:
    """A negative control ran and missed the reference by more than ``margin`` x the tolerance."""
    assert r["error"] is None, f"{r['name']}:\n{r['error']}"
    assert max(r["grad_diff"], r["loss_diff"]) > margin * TOL, r
