"""A real sequence-schedule step on one device, through the plain-torch API, against the whole sequence.

torch's runtime puts stage s of a looped pipeline on rank s mod p, so with p = 1 InterleavedSeq1F1B's two
model chunks (stages 0 and 1 of one pipeline) are both on this one rank, and the runtime hands stage 0's
output to stage 1, and stage 1's input gradient back, without communication (what it does at a V
schedule's turn). One process and a process group of one (NCCL on CUDA, gloo on the CPU) run N
microbatches x k units through :class:`~torchtitan_seq.schedules.stage.SequencePipelineStage` stages, cut from the
model as the trainer cuts it (``torchtitan_seq.titan.v022.pipeline.split_model``); torchtitan's Llama 3 on the whole
sequence, same weights, in float32 is the reference.

In float32 (the CPU dry run) the step must match the reference to fp32 round-off. In bf16 (the GPU, whose
unit kernels take no float32) it must come as close as the whole model run in bf16 does: at most twice
that model's error plus one bf16 epsilon, per figure (loss, and the largest gradient error).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["StepSizes", "FULL_STEP", "TINY_STEP", "check_sequence_step"]

FP32_TOL = 1e-5
SCHEDULE = "InterleavedSeq1F1B"


@dataclass(frozen=True)
class StepSizes:
    """The model (torchtitan ``TransformerModelArgs`` fields) and the step's shape."""

    model: dict
    seq_len: int
    k: int
    microbatches: int
    dtype: torch.dtype
    weight_std: float | None  # matrices redrawn with this std (None: torchtitan's initialisation)


FULL_STEP = StepSizes(
    model=dict(dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, multiple_of=256, rope_theta=500000, vocab_size=2048),
    seq_len=8192,
    k=4,
    microbatches=2,
    dtype=torch.bfloat16,
    weight_std=None,
)
# tests/helpers/harness.py's model and weights: every gradient far above fp32 round-off
TINY_STEP = StepSizes(
    model=dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=16, rope_theta=10000, vocab_size=64),
    seq_len=64,
    k=4,
    microbatches=2,
    dtype=torch.float32,
    weight_std=0.1,
)


def _whole_step(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, dict]:
    """Loss (token sum over the batch's tokens) and gradients of the whole sequence."""
    from torchtitan.components.loss import cross_entropy_loss

    model.zero_grad(set_to_none=True)
    loss = cross_entropy_loss(model(tokens), labels) / labels.numel()
    loss.backward()
    return float(loss), {n: p.grad.float() for n, p in model.named_parameters()}


def _pipeline_step(
    model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, sizes: StepSizes, device: torch.device
) -> tuple[float, dict, list[int]]:
    """Loss and gradients of one InterleavedSeq1F1B step, p = 1 and v = 2, and the unit lengths."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    from torchtitan_seq.runtime.loss import TokenNormalizedLoss
    from torchtitan_seq.runtime.partition import partition_sequence
    from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
    from torchtitan_seq.schedules.stage import SequencePipelineStage
    from torchtitan_seq.titan.v022.pipeline import split_model

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("pp",))
    num_stages = 2
    names = generate_llm_fqn_per_model_part(num_stages, sizes.model["n_layers"], 1, 1)
    chunks = split_model(model, mesh, SCHEDULE, device, names)
    assert [index for index, _, _ in chunks] == list(range(num_stages)), "both stages on this rank"
    lengths = partition_sequence(sizes.seq_len, sizes.k, "even")
    stages = [
        SequencePipelineStage(
            chunk, index, num_stages, device, lengths=lengths, chain_length=chain, group=mesh.get_group()
        )
        for index, chain, chunk in chunks
    ]
    loss_fn = TokenNormalizedLoss(cross_entropy_loss)
    schedule = SEQUENCE_SCHEDULES[SCHEDULE](stages, sizes.microbatches, loss_fn)
    losses: list[torch.Tensor] = []
    with loss_fn.normalized_by(labels.numel()):
        schedule.step(tokens, target=labels, losses=losses)
    grads = {n: p.grad.float() for _, _, chunk in chunks for n, p in chunk.named_parameters()}
    return float(sum(losses)), grads, lengths


def _errors(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> dict:
    """|loss - reference| / |reference| and, over the parameters, the largest
    max |grad - reference| / max |reference|."""
    rel = {n: float((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max()) for n, g in grads.items()}
    assert set(rel) == set(ref_grads), "every parameter has its gradient"
    worst = max(rel, key=rel.get)
    return {"loss": abs(loss - ref_loss) / abs(ref_loss), "grad": rel[worst], "worst_param": worst}


def check_sequence_step(sizes: StepSizes, device: torch.device) -> dict:
    """One step through the sequence schedule on ``device``; see the module docstring."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer

    args = TransformerModelArgs(**sizes.model, max_seq_len=sizes.seq_len)
    torch.manual_seed(0)
    with torch.device(device), torch.no_grad():
        seq = SeqTransformer(args)
        seq.init_weights()
        for p in seq.parameters():
            if sizes.weight_std is not None and p.dim() == 2:
                p.normal_(0.0, sizes.weight_std)
        reference = Transformer(args)
    reference.load_state_dict(seq.state_dict())
    gen = torch.Generator().manual_seed(1)
    batch = 2 * sizes.microbatches
    tokens, labels = (
        torch.randint(args.vocab_size, (batch, sizes.seq_len), generator=gen).to(device) for _ in range(2)
    )
    ref_loss, ref_grads = _whole_step(reference, tokens, labels)
    runs = {"units": seq}
    if sizes.dtype != torch.float32:
        runs["whole"] = copy.deepcopy(reference)
    for model in runs.values():
        # Children only: the model's own buffer is the complex RoPE table, which a real dtype would drop.
        for child in model.children():
            child.to(sizes.dtype)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        loss, grads, lengths = _pipeline_step(runs["units"], tokens, labels, sizes, device)
    finally:
        dist.destroy_process_group()
    record = {
        "schedule": SCHEDULE,
        "pp": 1,
        "stages": 2,
        "microbatches": sizes.microbatches,
        "k": sizes.k,
        "lengths": lengths,
        "seq_len": sizes.seq_len,
        "batch": batch,
        "dtype": str(sizes.dtype).removeprefix("torch."),
        "model": sizes.model,
        "backend": backend,
        "reference": "torchtitan's Llama 3, whole sequence, float32",
        "loss": loss,
        "reference_loss": ref_loss,
        "units": _errors(loss, grads, ref_loss, ref_grads),
    }
    if "whole" in runs:
        record["whole"] = _errors(*_whole_step(runs["whole"], tokens, labels), ref_loss, ref_grads)
        eps = torch.finfo(sizes.dtype).eps
        ok = all(record["units"][f] <= 2 * record["whole"][f] + eps for f in ("loss", "grad"))
    else:
        ok = record["units"]["loss"] < FP32_TOL and record["units"]["grad"] < FP32_TOL
    record["status"] = "ok" if ok else "failed"
    return record
