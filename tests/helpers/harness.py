"""The exactness harness: a sequence schedule on gloo ranks against the full-sequence reference.

Each variant builds a tiny Llama 3 (GQA, fp32), computes the reference loss and
gradients on the whole sequence in one process, then trains the same weights
under a schedule on ``pp`` gloo ranks (v model chunks each for a multi-stage
schedule, placed as torchtitan places them) and reports the largest
differences, each relative to its own reference: a parameter's gradient error
over the largest magnitude of that parameter's reference gradient, the loss
error over the reference loss. With ``optimizer_steps`` both sides first take
that many SGD steps, so the compared step also checks what happens between
steps (BSIPipe's and Chimera's copies). The compared step runs once per kernel of
``kernels``, from the same weights in the same rank processes: torch's CPU kernel (causal masks
aligned top-left) and :mod:`bottom_right`'s (aligned bottom-right, the one-call path of flash-attn and
torch's CUDA flash kernel), each
reported and checked on its own. A ``mutation`` (:mod:`mutations`) breaks one mechanism on purpose.

A variant runs in named steps (:func:`_run_variant`): the models, the batches, this rank's
parallelised chunks and stages, the mutation's patches, the training of both sides, the
report; :func:`run_variants` spawns the ranks and merges their reports. The tests using it
are in ``tests/exactness/`` (torchtitan 0.2.2) and ``tests/titan03/test_titan03_harness.py`` (0.3).
What goes through torchtitan (the model and its args, the chunks, their parallelisation on
``ParallelDims``' mesh, the loss, the context of a step) is the installed version's, from
:mod:`harness_titan`; the rest is plain torch and torchtitan_seq, the same under both.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.forkserver
import os
import socket
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness_titan import TITAN, DenseDocumentAttention, init_test_weights  # noqa: F401  (the harness's API)
from host_reads import reads_during_units
from torchtitan_seq.schedules.bidirectional import STEP_COUNTERS

TOL = 1e-5  # relative; fp32 round-off stays below 1e-6 here
GRAD_FLOOR = 5e-4  # every parameter's largest reference gradient is at least this: 1e4 x fp32 round-off
LR = 0.1  # SGD between compared steps: a missed update shows, gradients stay above GRAD_FLOOR


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
    steps: int = 1  # steps run on the same batch; the last one is compared
    layers: int = 4  # of the tiny model: pp * v stages need enough of them
    ac: str = "none"  # torchtitan activation checkpointing: none, full, selective:<layers|op>
    dp_shard: int = 1  # FSDP2 degree, through torchtitan's parallelize_llama
    dp_replicate: int = 1  # replicas of the FSDP2 shards (HSDP), each training its own rows, likewise
    tp: int = 1  # tensor-parallel degree, likewise
    cp: int = 1  # context-parallel degree: each unit's queries over cp ranks (FSDP then spans them)
    compile: str | None = None  # torch.compile backend of torchtitan's per-block compile, e.g. "inductor"
    documents: bool = False  # packed documents (block-causal attention), laid out by packed_tokens
    optimizer_steps: int = 0  # SGD steps (and BSIPipe/Chimera copy syncs) on both sides before the compared step
    mutation: str | None = None  # a mechanism broken on purpose: a key of mutations.MUTATIONS
    # unit attention's kernels, each checked on the compared step: torch's CPU kernel (causal masks aligned
    # top-left) and bottom_right.py's (bottom-right: the one-call path of flash-attn and torch's CUDA flash)
    kernels: tuple[str, ...] = ("top_left", "bottom_right")
    pre_split: bool = False  # step() given one entry per microbatch (arg_mbs, ...), as torch 2.14's step takes them
    # the tiny model's: llama3, qwen3, qwen3_moe; under 0.2.2 also deepseek_v3, deepseek_v3_q_lora, llama4
    # and gpt_oss (harness_titan.Titan022.model_args)
    family: str = "llama3"
    kv_context: str = "reach"  # what the KV context keeps: "reach", "full" (every key) or "latent" (MLA's latent)
    # after the compared step, the schedule's eval too (forward only, as torchtitan's validator calls it on
    # microbatches): its loss is compared, and it must leave the KV context empty
    evaluate: bool = False
    kv_offload: bool = False  # sequence_pipeline.kv_offload: idle K/V arenas copied to host memory and back

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks, each training its own rows of the batch: replicas x FSDP shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages_per_rank(self) -> int:
        from torchtitan_seq.schedules import SEQUENCE_SCHEDULES

        return SEQUENCE_SCHEDULES[self.schedule].stages_per_rank

    @property
    def batch_size(self) -> int:
        """Rows of a step's batch over all data-parallel ranks: per microbatch two, or one per data-parallel rank."""
        return max(2, self.dp) * self.microbatches


model_args = TITAN.model_args  # the tiny model's args (0.2.2's TransformerModelArgs; 0.3: its shape)


EOS = 0
# Document lengths per batch row, for seq_len 32 (scaled to others); None: no EOS at all.
# Row 0: a unit of 8 holding two whole documents, a document ending exactly at the
# boundary 16 after spanning two units, one spanning the last two; row 2: a document
# over two and a half units; row 3: one-token documents; row 4: one document ended by EOS.
DOCUMENT_LAYOUTS = [[3, 2, 2, 9, 16], None, [20, 12], [1, 30, 1], [32]]


def packed_tokens(batch: int, seq_len: int, g: torch.Generator, shift: int = 0) -> torch.Tensor:
    """(batch, seq_len) tokens whose EOS tokens end the documents of ``DOCUMENT_LAYOUTS``."""
    tokens = torch.randint(1, 64, (batch, seq_len), generator=g)
    for row in range(batch):
        layout = DOCUMENT_LAYOUTS[(row + shift) % len(DOCUMENT_LAYOUTS)]
        if layout is not None:
            tokens[row, torch.tensor(layout).cumsum(0) * seq_len // 32 - 1] = EOS
    return tokens


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def dp_rank_of(rank: int, v: Variant) -> int:
    """Data-parallel coordinate of ``rank`` in torchtitan's mesh order (pp, dp_replicate, dp_shard, cp, tp)."""
    return rank // (v.tp * v.cp) % v.dp


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _canonical(name: str) -> str:
    """A chunk's parameter or buffer name as the whole model names it."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def expert_counts(model: torch.nn.Module, zero: bool = False) -> dict[str, torch.Tensor]:
    """The tokens routed to each expert that ``model``'s MoE layers counted (torchtitan's
    ``tokens_per_expert``, 0.3's ``tokens_per_expert_E``, read by its load-balancing update), by the
    whole model's buffer names;
    ``zero``: counted from zero on from now."""
    counts = {}
    for name, buffer in model.named_buffers():
        if name.rsplit(".", 1)[-1] in STEP_COUNTERS:
            counts[_canonical(name)] = buffer.clone()
            if zero:
                buffer.zero_()
    return counts


def _relative_errors(chunks, ref_grads: dict) -> dict[str, float]:
    """Per parameter of this rank's primary chunks: max |grad - reference| / max |reference|.

    A BSIPipe or Chimera chunk's gradient ends on its chain-A copy (stage index < chain length).
    """
    errors = {}
    for index, chain, chunk in chunks:
        if index >= chain:
            continue
        for n, p in chunk.named_parameters():
            ref = ref_grads[_canonical(n)]
            errors[n] = (
                float((_full(p.grad) - ref).abs().max() / ref.abs().max()) if p.grad is not None else float("inf")
            )
    return errors


@dataclass
class Batch:
    """One step's data, (batch, seq_len) each: token ids, labels, and document ids (None: causal)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    documents: torch.Tensor | None = None


def _batches(v: Variant, vocab_size: int) -> list[Batch]:
    """One batch per step, ``optimizer_steps + 1`` of them: the compared (last) step's gradients are
    not those of a batch the optimizer steps already fitted (small gradients, all cancellation)."""
    g = torch.Generator().manual_seed(1)
    pairs = [
        tuple(torch.randint(0, vocab_size, (v.batch_size, v.seq_len), generator=g) for _ in range(2))
        for _ in range(v.optimizer_steps + 1)
    ]
    if not v.documents:
        return [Batch(tokens, labels) for tokens, labels in pairs]
    from torchtitan_seq.runtime.documents import document_ids

    # the compared (last) batch has DOCUMENT_LAYOUTS' first rows; earlier ones others
    tokens = [packed_tokens(v.batch_size, v.seq_len, g, shift=len(pairs) - 1 - i) for i in range(len(pairs))]
    return [Batch(t, labels, document_ids(t, EOS)) for t, (_, labels) in zip(tokens, pairs)]


def _data_parallel_rows(v: Variant, rank: int) -> slice:
    """The batch rows ``rank`` trains on: its data-parallel slice of the batch."""
    if v.dp == 1:
        return slice(None)
    n = v.batch_size // v.dp
    return slice(dp_rank_of(rank, v) * n, (dp_rank_of(rank, v) + 1) * n)


class _Reference:
    """The whole model in one process, stepped by SGD as the pipeline's chunks are."""

    def __init__(self, model: torch.nn.Module, rows: slice) -> None:
        self.model, self.rows = model, rows
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, b: Batch) -> tuple[float, dict[str, torch.Tensor]]:
        """The gradients of the whole batch's loss, and this rank's rows' share of that loss."""
        cross_entropy_loss = TITAN.cross_entropy_loss
        self.model.zero_grad(set_to_none=True)
        logits = TITAN.logits(self.model, b.tokens, b.documents)  # (batch, seq_len, vocab)
        (cross_entropy_loss(logits, b.labels) / b.labels.numel()).backward()
        loss = float(cross_entropy_loss(logits[self.rows], b.labels[self.rows]) / b.labels.numel())
        return loss, {n: p.grad.clone() for n, p in self.model.named_parameters()}


def _kernel(name: str):
    """Unit attention's kernel ``name``: "top_left", torch's CPU kernel (the device's), or "bottom_right"."""
    if name == "bottom_right":
        from bottom_right import BottomRightCpuKernel

        return BottomRightCpuKernel()
    if name != "top_left":
        raise ValueError(f"unknown kernel {name!r}")
    from torchtitan_seq.attention.kernels import select_kernel

    return select_kernel(torch.device("cpu"))


def _stages(v: Variant, args, chunks, dims) -> list:
    """This rank's pipeline stages over ``chunks``, cut into the variant's units, with its first kernel."""
    from torchtitan_seq.runtime.context_parallel import ContextShard
    from torchtitan_seq.runtime.shape import JobShape
    from torchtitan_seq.schedules.stage import SequencePipelineStage
    from torchtitan_seq.titan.flavors import model_shape

    # Cut as the runtime cuts: sequence parallelism shards every unit evenly over the TP ranks, CP
    # into 2 cp chunks.
    lengths = JobShape.of_model(model_shape(args), v.seq_len, v.k, v.partition, tp=v.tp, cp=v.cp).lengths
    shard = ContextShard.of_group(dims.get_mesh("cp").get_group() if v.cp > 1 else None)
    pp_mesh = dims.get_mesh("pp")
    return [
        SequencePipelineStage(
            chunk,
            index,
            v.pp * v.stages_per_rank,
            torch.device("cpu"),
            kernel=_kernel(v.kernels[0]),
            lengths=lengths,
            chain_length=chain,
            context_shard=shard,
            kv_context=v.kv_context,
            kv_offload=v.kv_offload,
            group=pp_mesh.get_group(),
        )
        for index, chain, chunk in chunks
    ]


def _use_kernel(stages: list, name: str) -> None:
    """Every attention layer of ``stages`` calls kernel ``name`` from now on. The layers keep their
    bindings (the same ``ids``, which compiled graphs take as an input): only the kernel changes,
    which the unit attention op reads at run time, and the KV context places each step's slabs
    for the kernel that writes them."""
    from torchtitan_seq.attention import SequenceAttention

    kernel = _kernel(name)
    for stage in stages:
        for m in stage.submod.modules():
            if isinstance(m, SequenceAttention):
                m._binding.kernel = kernel


@contextlib.contextmanager
def _mutated(v: Variant, dims) -> Iterator[None]:
    """The variant's mutation (none without one) applied while the context is open."""
    from mutations import MutationContext, patches

    context = MutationContext(
        schedule=v.schedule,
        units_per_step=v.microbatches * v.k * v.dp,
        tp_group=dims.get_mesh("tp").get_group() if v.tp > 1 else None,
        replicate_group=dims.get_mesh("dp_replicate").get_group() if v.dp_replicate > 1 else None,
    )
    with contextlib.ExitStack() as stack:
        for patch in patches(v.mutation, context):
            stack.enter_context(patch)
        yield


class _PipelineRun:
    """This rank's stages under the variant's schedule and an SGD optimizer, and what each step
    leaves behind: saved activations, their peak, compiled graphs, the copies' difference."""

    def __init__(self, v: Variant, chunks, stages: list, rows: slice, dims) -> None:
        from torch._dynamo.utils import counters

        from torchtitan_seq.instrumentation.memory import ActivationMemory
        from torchtitan_seq.runtime.loss import TokenNormalizedLoss
        from torchtitan_seq.schedules import SEQUENCE_SCHEDULES

        self.rows = rows
        self.first, self.last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        loss_fn = TokenNormalizedLoss(TITAN.cross_entropy_loss)
        loss_fn.denominator = v.batch_size * v.seq_len
        self.optimizer = torch.optim.SGD([p for _, _, chunk in chunks for p in chunk.parameters()], lr=LR)
        self.memory = ActivationMemory()
        self.activations_left: list[int] = []
        self.peaks: list[int] = []
        self.graphs: list[int] = []  # compiled graphs so far, after each step
        self.copies_diff: list[float] = []
        self.host_reads: list[str] = []  # tensors read on the host during the units (host_reads.py)
        self.contexts = [s.kv_context for s in stages]
        self.steps_run = 0
        torch._dynamo.reset()  # graphs and counters of this variant alone
        counters.clear()
        self.schedule = SEQUENCE_SCHEDULES[v.schedule](stages, v.microbatches, loss_fn, split_backward=v.split_backward)
        self.pre_split = v.microbatches if v.pre_split else 0
        self.dims = dims
        # Forwards of the compared steps. Under activation checkpointing a recomputed MoE layer counts
        # its tokens again, as in torchtitan's own training (its TODO: its load balancing reads the
        # counts' signs only): the counts are not compared there.
        self.steps_per_compare = v.steps if v.ac == "none" else None

    def step(self, b: Batch, repeats: int = 1) -> list | None:
        """``repeats`` schedule steps on ``b``; the last stage's unit losses of the last one."""
        from torch._dynamo.utils import counters

        rows = self.rows
        for _ in range(repeats):
            self.optimizer.zero_grad(set_to_none=True)
            losses = [] if self.last else None
            tokens = b.tokens[rows] if self.first else None
            target = b.labels[rows] if self.last else None
            masks = b.documents[rows] if b.documents is not None else None
            # the schedule's first step infers the stages' shapes; every later one is instrumented
            reads = reads_during_units(self.contexts) if self.steps_run else contextlib.nullcontext([])
            with TITAN.step_context(self.dims), self.memory.track(), reads as seen:
                if self.pre_split:
                    n = self.pre_split
                    self.schedule.step(
                        arg_mbs=None if tokens is None else [(t,) for t in tokens.tensor_split(n)],
                        kwarg_mbs=None if masks is None else [{"attention_masks": m} for m in masks.tensor_split(n)],
                        target_mbs=None if target is None else list(target.tensor_split(n)),
                        losses=losses,
                    )
                else:
                    self.schedule.step(
                        *(() if tokens is None else (tokens,)), target=target, losses=losses, attention_masks=masks
                    )
            self.steps_run += 1
            self.host_reads += seen[:1]
            self.activations_left.append(self.memory.current)
            self.peaks.append(self.memory.peak)
            self.graphs.append(counters["stats"]["unique_graphs"])
        return losses

    def evaluate(self, b: Batch) -> list | None:
        """The schedule's ``eval`` on ``b``, in microbatches as torchtitan 0.3's validator hands them over,
        without gradients; the last stage's microbatch losses (None on other ranks)."""
        n, rows = self.schedule.num_microbatches, self.rows

        def split(t: torch.Tensor) -> list[torch.Tensor]:
            return list(t[rows].tensor_split(n))

        losses = [] if self.last else None
        masks = [{}] * n if b.documents is None else [{"attention_masks": m} for m in split(b.documents)]
        with TITAN.step_context(self.dims), torch.no_grad():
            self.schedule.eval(
                arg_mbs=[(t,) for t in split(b.tokens)] if self.first else None,
                kwarg_mbs=masks,
                target_mbs=split(b.labels) if self.last else None,
                losses=losses,
            )
        return losses

    def next_kernel(self) -> None:
        """The records of saved activations and host reads start again for the next kernel's steps
        (the graphs compiled so far are counted on: a kernel switch compiles nothing)."""
        self.activations_left, self.peaks, self.host_reads = [], [], []

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.schedule.after_optimizer_step()  # as the trainer's optimizer hook does
        if hasattr(self.schedule, "copies"):  # BSIPipe, Chimera
            self.copies_diff.append(self.schedule.copies.max_difference())


def _report(run: _PipelineRun, chunks, stages: list, losses: list | None, compared: tuple[float, dict], dims) -> dict:
    """This rank's side of the comparison with the reference's ``compared`` loss and gradients
    (:func:`run_variants` merges the ranks')."""
    from torch._dynamo.utils import counters

    ref_loss, ref_grads, ref_counts = compared
    errors = _relative_errors(chunks, ref_grads)
    worst = max(errors, key=errors.get)
    out = {
        "grad_rel": errors[worst],
        "worst_param": worst,
        "ref_grad_min": min(float(g.abs().max()) for g in ref_grads.values()),
        "kv_left": sum(len(s.kv_context) for s in stages),
        "activations_left": max(run.activations_left),
        "peaks": run.peaks,
        "mirror_grads": sum(
            p.grad is not None for index, chain, chunk in chunks if index >= chain for p in chunk.parameters()
        ),
        "copies_diff": run.copies_diff,
        "graphs": run.graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "host_reads": run.host_reads,
        "expert_counts_diff": _expert_counts_diff(chunks, ref_counts, run.steps_per_compare, dims),
    }
    if (loss_rel := _loss_rel(run, losses, ref_loss, dims)) is not None:
        out["loss_rel"] = loss_rel
        out["n_losses"] = len(losses)
    return out


def _loss_rel(run: _PipelineRun, losses: list | None, ref_loss: float, dims) -> float | None:
    """The pipeline's loss from each last stage's ``losses`` (BSIPipe and Chimera have two; the pipeline's
    sum is the loss, and under CP the sum of the CP ranks' shares), relative to the reference's; None on
    ranks without a last stage."""
    loss = torch.tensor(float(sum(losses)) if run.last else 0.0)
    dist.all_reduce(loss, group=dims.get_mesh("pp").get_group())
    if dims.cp > 1:
        dist.all_reduce(loss, group=dims.get_mesh("cp").get_group())
    return abs(loss.item() - ref_loss) / abs(ref_loss) if run.last else None


def _expert_counts_diff(chunks, ref_counts: dict, steps: int | None, dims) -> float:
    """The largest difference between the tokens per expert this rank's primary chunks counted in the
    compared steps, summed over the data-parallel ranks, and the reference's whole batch's, ``steps``
    times; 0.0 for a model without MoE, or where ``steps`` is None (not compared)."""
    worst = 0.0
    if steps is None:
        return worst
    for index, chain, chunk in chunks:
        if index >= chain:
            continue
        for name, counted in expert_counts(chunk).items():
            if dims.dp_replicate * dims.dp_shard > 1:
                dist.all_reduce(counted, group=dims.get_mesh("batch").get_group())
            worst = max(worst, float((counted - steps * ref_counts[name]).abs().max()))
    return worst


def _run_variant(v: Variant, rank: int) -> dict:
    """Train the reference and the pipeline on the same batches; report the compared step, once
    per kernel of the variant: the optimizer steps before it run with the first kernel, then each
    kernel runs the compared step from the same weights (the gradients start again at none)."""
    args, whole, model = TITAN.models(v)
    batches = _batches(v, args.vocab_size)
    rows = _data_parallel_rows(v, rank)
    reference = _Reference(model, rows)
    chunks, dims = TITAN.pipeline_chunks(whole, args, v)
    stages = _stages(v, args, chunks, dims)
    reports = {}
    with _mutated(v, dims):
        run = _PipelineRun(v, chunks, stages, rows, dims)
        for b in batches[:-1]:
            run.step(b)
            reference.step(b)
            run.optimizer_step()
            reference.optimizer.step()
        expert_counts(model, zero=True)
        compared = (*reference.step(batches[-1]), expert_counts(model))
        for i, kernel in enumerate(v.kernels):
            if i:
                _use_kernel(stages, kernel)
                run.next_kernel()
            for _, _, chunk in chunks:
                expert_counts(chunk, zero=True)
            losses = run.step(batches[-1], repeats=v.steps)
            reports[kernel] = _report(run, chunks, stages, losses, compared, dims)
            if v.evaluate:  # after the step's report: torch's eval prepares the stages again, gradients cleared
                eval_rel = _loss_rel(run, run.evaluate(batches[-1]), compared[0], dims)
                reports[kernel].update({} if eval_rel is None else {"eval_loss_rel": eval_rel})
                reports[kernel]["kv_left"] += sum(len(s.kv_context) for s in stages)
    return {"kernels": reports}


def _worker(rank: int, world: int, port: int, variants: list[Variant], out_dir: str) -> None:
    """One rank: every variant in turn in one gloo process group, the reports to ``out_dir``."""
    import json

    import torch._functorch.config
    import torch._inductor.config

    from torchtitan_seq.titan import cpu_compat

    cpu_compat.apply()  # before torchtitan is imported

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The ranks fill the cores: inductor compiles in the rank, without a pool of workers to start.
    torch._inductor.config.compile_threads = 1
    # A rank waits this long for a peer before the job ends with a message: one compiling a variant's
    # blocks while CI's other lane shares the 2 cores can take minutes.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    results = []
    for v in variants:
        # what torchtitan sets globally for a variant (memory-budget AC) ends with it
        restore = torch._functorch.config.patch(
            activation_memory_budget=torch._functorch.config.activation_memory_budget
        )
        try:
            with restore:
                results.append(_run_variant(v, rank))
        except Exception:  # reported, not raised: the peers must reach the barrier
            results.append({"error": traceback.format_exc()[-3000:]})
            print(f"rank {rank}, {v.name}:\n{results[-1]['error']}", file=sys.stderr, flush=True)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _merge(name: str, recs: list[dict]) -> dict:
    """One variant's report over all ranks, from each rank's (:func:`_report`, or its error)."""
    errors = [r["error"] for r in recs if "error" in r]
    return {
        "name": name,
        "error": errors[0] if errors else None,
        "grad_rel": max((r.get("grad_rel", float("inf")) for r in recs), default=float("inf")),
        "worst_param": max(recs, key=lambda r: r.get("grad_rel", float("inf"))).get("worst_param"),
        "ref_grad_min": min((r.get("ref_grad_min", 0.0) for r in recs), default=0.0),
        "loss_rel": max((r["loss_rel"] for r in recs if "loss_rel" in r), default=float("inf")),
        "eval_loss_rel": max((r["eval_loss_rel"] for r in recs if "eval_loss_rel" in r), default=None),
        "kv_left": sum(r.get("kv_left", 0) for r in recs),
        "activations_left": max(r.get("activations_left", 0) for r in recs),
        "peaks": [r.get("peaks") for r in recs],
        "n_losses": next((r["n_losses"] for r in recs if "n_losses" in r), None),
        "mirror_grads": sum(r.get("mirror_grads", 0) for r in recs),
        "copies_diff": [max(d) for d in zip(*(r.get("copies_diff", []) for r in recs))],
        "graphs": [r.get("graphs") for r in recs],
        "graph_breaks": sum(r.get("graph_breaks", 0) for r in recs),
        "host_reads": [read for r in recs for read in r.get("host_reads", [])],
        "expert_counts_diff": max((r.get("expert_counts_diff", float("inf")) for r in recs), default=float("inf")),
    }


def _start_fork_server() -> None:
    """Start, once per process, the fork server the ranks are forked from, with :mod:`rank_imports`
    imported: a process group of w ranks then starts in about a second, not w x 6 s of CPU."""
    multiprocessing.set_forkserver_preload(["rank_imports"])
    # The server imports it from PYTHONPATH: Python 3.11's server ignores the sys.path it is sent.
    helpers = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [helpers, os.environ.get("PYTHONPATH")]))
    with mock.patch.dict(os.environ, PYTHONPATH=path):
        multiprocessing.forkserver.ensure_running()


def run_variants(variants: list[Variant], tmp_path) -> list[dict]:
    """Run ``variants`` (all on the same number of ranks) in one process group and merge the
    per-rank reports."""
    import json

    world = variants[0].world
    assert all(v.world == world for v in variants)
    _start_fork_server()
    mp.start_processes(
        _worker, args=(world, _free_port(), variants, str(tmp_path)), nprocs=world, join=True, start_method="forkserver"
    )
    per_rank = [json.load(open(os.path.join(tmp_path, f"rank{r}.json"))) for r in range(world)]
    return [_combine(v, [per_rank[r][i] for r in range(world)]) for i, v in enumerate(variants)]


def _combine(v: Variant, recs: list[dict]) -> dict:
    """One variant's report: ``kernels``, each kernel's (:func:`_merge`, named "<variant> [<kernel>]"),
    and beside it the worst kernel's fields over all of them (what was left after any step, graphs
    and graph breaks of the whole run; the copies' differences are the optimizer steps', before the
    kernels split)."""
    per = {
        kernel: _merge(f"{v.name} [{kernel}]", [r["kernels"][kernel] if "kernels" in r else r for r in recs])
        for kernel in v.kernels
    }
    worst = max(per.values(), key=lambda m: max(m["grad_rel"], m["loss_rel"]))
    last = per[v.kernels[-1]]
    return {
        **worst,
        "name": v.name,
        "error": next((m["error"] for m in per.values() if m["error"] is not None), None),
        "kv_left": sum(m["kv_left"] for m in per.values()),
        "activations_left": max(m["activations_left"] for m in per.values()),
        "mirror_grads": sum(m["mirror_grads"] for m in per.values()),
        "peaks": None,  # per kernel: r["kernels"][kernel]["peaks"]
        "graphs": last["graphs"],
        "graph_breaks": last["graph_breaks"],
        "kernels": per,
    }


def assert_exact(r: dict, n_losses: int | None = None) -> None:
    """A variant matched the reference with each of its kernels: loss and every gradient within
    ``TOL`` of their own scale, an empty KV context and no saved activation left after the step."""
    assert r["error"] is None, f"{r['name']}:\n{r['error']}"
    assert r["kernels"], r
    for k in r["kernels"].values():
        assert k["ref_grad_min"] >= GRAD_FLOOR, k  # else a wrong gradient could hide in round-off
        assert k["loss_rel"] <= TOL and k["grad_rel"] <= TOL, k
        assert k["eval_loss_rel"] is None or k["eval_loss_rel"] <= TOL, k  # the schedule's eval, where it ran
        assert k["kv_left"] == 0, k
        assert k["activations_left"] == 0, k
        assert k["expert_counts_diff"] == 0, k  # an MoE's tokens per expert, as the whole batch routes them
        # torchtitan's MoE experts read their token counts on the host in its for-loop fallback, the CPU's
        # (its grouped GEMMs, which a GPU runs, do not): not the unit path's
        reads = [r for r in k["host_reads"] if "_run_experts_for_loop" not in r]
        assert not reads, f"{k['name']}: a tensor read on the host during the units:\n{reads[0]}"
        if n_losses is not None:
            assert k["n_losses"] == n_losses, k  # one loss per microbatch, as torch's schedules


def assert_breaks_exactness(r: dict, margin: float = 100) -> float:
    """A mutation ran and, with each of the variant's kernels, missed the reference by more than
    ``margin`` x the tolerance; returns the smallest of their relative errors."""
    assert r["error"] is None, f"{r['name']}:\n{r['error']}"
    assert r["kernels"], r
    errors = {
        kernel: max(k["grad_rel"], k["loss_rel"], k["eval_loss_rel"] or 0.0) for kernel, k in r["kernels"].items()
    }
    for kernel, error in errors.items():
        assert error > margin * TOL, r["kernels"][kernel]
    return min(errors.values())
