"""What the exactness harness (:mod:`harness`) does differently per torchtitan version.

The harness itself is plain torch and torchtitan_seq; five things go through torchtitan and differ
between 0.2.2 and 0.3: building the tiny Llama 3 (its args, its chunk-aware model), splitting it into
this rank's chunks, parallelising each chunk with the version's parallelize function on its
``ParallelDims`` mesh, the summed cross-entropy loss, and the context a pipeline step runs in.
:data:`TITAN` is the installed version's adapter (:data:`torchtitan_seq.titan.version.TITAN_03`):

- :class:`Titan022`: torchtitan 0.2.2's model args of the family (Llama 3, Qwen3, DeepSeek-V3, Llama 4,
  gpt-oss), its model class behind torchtitan_seq's seam
  (:func:`~torchtitan_seq.titan.v022.models.sequence_model.sequence_model_class`), chunks placed by
  :func:`torchtitan_seq.titan.v022.pipeline.split_model` and parallelised by the family's parallelize
  function with a ``JobConfig`` (the CP ranks as FSDP's,
  :func:`~torchtitan_seq.titan.v022.pipeline.chunk_parallel_dims`); the flex families' reference is
  torchtitan's own model class with its own masks (:mod:`flex_reference`).
- :class:`Titan03`: torchtitan 0.3's Llama 3 or Qwen3 (dense or MoE, the shape of Titan022's), DeepSeek-V3
  or gpt-oss (MLA; sliding windows and sinks) built from configs with
  :class:`~torchtitan_seq.titan.v03.model.SeqInnerAttention` in every layer (as
  :func:`~torchtitan_seq.titan.v03.model.sequence_model_spec` builds a flavor), its reference the family's
  own attention modules over dense attention under 0.3's own mask modifiers, chunks cut by 0.3's
  ``_split_module`` as :mod:`torchtitan_seq.titan.v03.pipeline` cuts them, parallelised by the family's
  model spec's ``parallelize_fn`` (keyword configs: ``training``, ``parallelism``, ``compile_config``,
  ``ac_config``), pipeline steps inside 0.3's SPMD context (its ``spmd_types`` backend, as the
  trainer's ``train_context``; under CP both with the CP ranks as FSDP's, the degrees of
  :func:`~torchtitan_seq.titan.v03.pipeline.chunk_parallel_dims`). 0.3's families fuse wq, wk and wv into
  one ``wqkv``; the names the harness compares are each version's own, on both sides.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any

import torch

from torchtitan_seq.titan.version import TITAN_03

__all__ = ["TITAN", "Titan022", "Titan03", "DenseDocumentAttention", "init_test_weights"]

# The tiny model of every variant: GQA (4 query heads, 2 K/V heads), fp32.
DIM, HEADS, KV_HEADS, VOCAB, MULTIPLE_OF, ROPE_THETA = 32, 4, 2, 64, 16, 10000
QWEN3_HEAD_DIM = 12  # not DIM / HEADS: Qwen3's heads have a width of their own
# torchtitan 0.2.2's flex families, their reach crossing the harness's units (of 8 at seq_len 32, k 4)
FLEX_FAMILIES = ("deepseek_v3", "deepseek_v3_q_lora", "llama4", "gpt_oss")
FLEX_WINDOW, FLEX_CHUNK = 6, 12
WINDOW = 6  # gpt-oss's sliding window: narrower than every unit, so windows cross units


class DenseDocumentAttention(torch.nn.Module):
    """The reference's inner attention: SDPA with the dense document mask, or causal; q, k, v and the
    output (B, heads, L, head_dim). Under 0.2.2 its layer hands it the call's document ids as
    ``documents``, as it hands torchtitan_seq's."""

    documents: torch.Tensor | None = None

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True, documents=None):
        from torchtitan_seq.runtime.documents import document_mask

        documents = self.documents if documents is None else documents
        mask = None if documents is None else document_mask(documents)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
        )


class Titan022:
    """torchtitan 0.2.2's side of the harness."""

    version = "0.2.2"

    def model_args(self, seq_len: int, n_layers: int = 4, family: str = "llama3"):
        """The tiny model's args of ``family``: Llama 3's, Qwen3's (QK-norm, head dims of their own,
        ``qwen3_moe``: every MLP an MoE of 4 experts, 2 routed a token, one shared) or a flex family's
        (:meth:`_flex_family_args`)."""
        shape = dict(
            dim=DIM,
            n_layers=n_layers,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            vocab_size=VOCAB,
            max_seq_len=seq_len,
            rope_theta=ROPE_THETA,
        )
        if family == "llama3":
            from torchtitan.models.llama3 import TransformerModelArgs

            return TransformerModelArgs(**shape, multiple_of=MULTIPLE_OF)
        if family in FLEX_FAMILIES:
            return self._flex_family_args(shape, family)
        from torchtitan.models.moe import MoEArgs
        from torchtitan.models.qwen3 import Qwen3ModelArgs

        return Qwen3ModelArgs(
            **shape,
            head_dim=QWEN3_HEAD_DIM,
            hidden_dim=2 * DIM,
            qk_norm=True,
            moe_enabled=family == "qwen3_moe",
            moe_inter_dim=DIM,
            moe_args=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, use_grouped_mm=False),
        )

    @staticmethod
    def _flex_family_args(shape: dict, family: str):
        """A flex flavor's tiny args (causal; :meth:`models` makes them block-causal with documents), MoE
        layers of 4 experts routing 2 a token with the load-balancing bias on:

        - ``deepseek_v3``: MLA (queries and keys 8 + 4 RoPE wide, values 6), the first layer dense, the
          others MoE with a shared expert; ``deepseek_v3_q_lora``: queries through a rank-16 LoRA too;
        - ``llama4``: irope, the even layers NoPE and the odd ones attending within chunks of
          ``FLEX_CHUNK``, every second layer MoE with a shared expert;
        - ``gpt_oss``: the even layers within a sliding window of ``FLEX_WINDOW``, sinks, biases, every
          layer MoE (no shared expert, gate biases).
        """
        from torchtitan.models.moe import MoEArgs

        moe = dict(num_experts=4, top_k=2, use_grouped_mm=False, load_balance_coeff=1e-3)
        common = dict(vocab_size=VOCAB, dim=DIM, n_layers=shape["n_layers"], max_seq_len=shape["max_seq_len"])
        if family.startswith("deepseek_v3"):
            from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs

            args = DeepSeekV3ModelArgs(
                **common,
                n_heads=HEADS,
                inter_dim=2 * DIM,
                moe_inter_dim=DIM,
                n_dense_layers=1,
                moe_args=MoEArgs(**moe, num_shared_experts=1, score_func="softmax", score_before_experts=False),
                q_lora_rank=16 if family == "deepseek_v3_q_lora" else 0,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=6,
                rope_theta=ROPE_THETA,
                attn_type="flex",
            )
            args.moe_impl = "standard"  # as its update_from_config sets it
            return args
        if family == "llama4":
            from torchtitan.models.llama4.model.args import TransformerModelArgs

            return TransformerModelArgs(
                **common,
                n_heads=HEADS,
                n_kv_heads=KV_HEADS,
                multiple_of=MULTIPLE_OF,
                rope_theta=ROPE_THETA,
                moe_args=MoEArgs(**moe, num_shared_experts=1),
                interleave_moe_layer_step=2,
                every_n_layers_nope=2,
                fixed_attn_block_size=FLEX_CHUNK,
                attn_type="flex",
            )
        from torchtitan.models.gpt_oss import GptOssModelArgs

        return GptOssModelArgs(
            **common,
            moe_inter_dim=DIM,
            head_dim=DIM // HEADS,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            sliding_window_size=FLEX_WINDOW,
            rope_theta=ROPE_THETA,
            rope_factor=1.0,
            moe_args=MoEArgs(**moe, num_shared_experts=0, score_func="softmax", route_norm=True, gate_bias=True),
        )

    def models(self, v) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
        """``(args, whole, reference)``: the tiny model of the variant's family with the test weights, and
        the reference: Llama 3's and Qwen3's a copy whose attention is SDPA over the whole sequence (with
        the dense document mask); a flex family's torchtitan's own model class with the same weights and
        its own flex masks (:mod:`flex_reference`), gpt-oss's bf16 layers in float32 on both sides."""
        from torchtitan_seq.titan.v022.models.sequence_model import sequence_model_class

        args = self.model_args(v.seq_len, v.layers, v.family)
        if v.documents and v.family in FLEX_FAMILIES:
            args.attn_mask_type = "block_causal"
        own = self._spec(v.family).model_cls
        torch.manual_seed(0)
        whole = sequence_model_class(own)(args).float()
        init_test_weights(whole)
        if v.family in FLEX_FAMILIES:
            from flex_reference import use_mask_mod_attention

            reference = own(args).float()
            reference.load_state_dict(whole.state_dict())
            use_mask_mod_attention(reference)
            return args, whole, reference
        reference = copy.deepcopy(whole)
        for layer in reference.layers.values():
            layer.attention.inner_attention = DenseDocumentAttention()
        return args, whole, reference

    @staticmethod
    def _spec(family: str):
        """torchtitan's own train spec of ``family`` (its model class, its ``parallelize_fn``)."""
        import importlib

        packages = ("llama3", "qwen3", "deepseek_v3", "llama4", "gpt_oss")
        package = next(name for name in packages if family.startswith(name))
        return importlib.import_module(f"torchtitan.models.{package}").get_train_spec()

    def init_weights(self, model: torch.nn.Module) -> None:
        model.init_weights()

    def logits(self, model: torch.nn.Module, tokens: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """The reference's logits: torchtitan's own flex model with its own masks of ``tokens``, others
        handed the document ids."""
        if hasattr(model, "kv_context"):  # torchtitan_seq's
            return model(tokens, documents)
        from flex_reference import own_masks

        from harness import EOS

        return model(tokens, own_masks(model, tokens, EOS))

    def cross_entropy_loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The token losses' sum."""
        from torchtitan.components.loss import cross_entropy_loss

        return cross_entropy_loss(pred, labels)

    def pipeline_chunks(self, whole, args, v):
        """This rank's chunks of ``whole``, [(stage index, chain length, chunk)], parallelised as
        torchtitan does it, with the pipeline's mesh and torchtitan's ``ParallelDims``."""
        from torchtitan.config import JobConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

        from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
        from torchtitan_seq.titan.cpu_compat import fsdp_for_gloo
        from torchtitan_seq.titan.v022.pipeline import chunk_parallel_dims, split_model

        degrees = dict(dp_replicate=v.dp_replicate, dp_shard=v.dp_shard, cp=v.cp, tp=v.tp, pp=v.pp)
        dims = ParallelDims(**degrees, ep=1, etp=1, world_size=v.world)
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
        job.parallelism.data_parallel_replicate_degree = v.dp_replicate
        job.parallelism.tensor_parallel_degree = v.tp
        job.parallelism.context_parallel_degree = v.cp
        job.parallelism.disable_loss_parallel = True
        job.compile.enable = v.compile is not None
        job.compile.backend = v.compile or "inductor"
        job.training.mixed_precision_param = "float32"  # torchtitan's FSDP default is bf16
        mode, _, option = v.ac.partition(":")
        job.activation_checkpoint.mode = mode
        job.activation_checkpoint.selective_ac_option = option or "2"
        chunk_dims = chunk_parallel_dims(dims)  # as torchtitan_seq parallelises chunks inside torchtitan
        parallelize = self._spec(v.family).parallelize_fn
        chunks = [(index, chain, parallelize(chunk, chunk_dims, job)) for index, chain, chunk in split]
        fsdp_for_gloo([chunk for _, _, chunk in chunks])
        return chunks, dims

    def step_context(self, dims) -> contextlib.AbstractContextManager:
        """What a pipeline step runs in: nothing under 0.2.2."""
        return contextlib.nullcontext()


class _DenseDocumentAttention03(torch.nn.Module):
    """The reference's inner attention in 0.3's call: q, k, v and the output (B, L, heads, head_dim), values
    of a width of their own (MLA's), the document ids as ``attention_masks``. Dense attention under 0.3's own
    causal mask modifier, the layer's sliding window as 0.3's ``get_sliding_window_mask_mod`` masks it and
    the dense document mask; the layer's own ``out_transform`` (gpt-oss's sinks) on the output and the
    dense log-sum-exp, as 0.3's flex and varlen attentions apply it."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, out_transform=None):
        from torchtitan.models.common.attention import get_causal_mask_mod, get_sliding_window_mask_mod

        from torchtitan_seq.runtime.documents import document_mask

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, L, head_dim)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        positions = torch.arange(q.shape[2])
        query, key = positions[:, None], positions[None, :]
        mask = get_causal_mask_mod()(None, None, query, key)
        if self.window is not None:
            mask = mask & get_sliding_window_mask_mod(self.window)(None, None, query, key)
        if attention_masks is not None:
            mask = mask & document_mask(attention_masks)
        scores = (q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)).masked_fill(
            ~mask, float("-inf")
        )
        lse = scores.logsumexp(-1)  # (B, heads, L)
        out = ((scores - lse.unsqueeze(-1)).exp() @ v).transpose(1, 2)
        return out if out_transform is None else out_transform(out, lse.transpose(1, 2))


class Titan03:
    """torchtitan 0.3's side of the harness."""

    version = "0.3"

    def model_args(self, seq_len: int, n_layers: int = 4, family: str = "llama3"):
        """The tiny model's shape (torchtitan_seq's :class:`~torchtitan_seq.titan.flavors.ModelShape`, which
        the partition's cost model reads as it reads 0.2.2's args), read from its 0.3 config."""
        from torchtitan_seq.titan.flavors import model_shape

        return model_shape(_config03(seq_len, n_layers, family))

    def model_config(self, v):
        """0.3's config of the variant's tiny model, its inner attention torchtitan_seq's (as
        :func:`~torchtitan_seq.titan.v03.model.sequence_model_spec` builds a flavor), block-causal with
        documents."""
        from torchtitan_seq.titan.v03.model import sequence_model_config

        return sequence_model_config(_config03(v.seq_len, v.layers, v.family), block_causal=v.documents)

    def configs(self, v) -> dict[str, Any]:
        """The configs 0.3 hands a ``parallelize_fn`` (but ``parallel_dims``)."""
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

        policies = {"full": FullAC, "selective": SelectiveAC, "memory_budget": MemoryBudgetAC}
        mode, _, option = v.ac.partition(":")
        if mode != "none" and mode not in policies:
            raise ValueError(f"activation checkpointing {v.ac!r}: 0.3's harness runs none, {', '.join(policies)}")
        return {
            "training": TrainingConfig(seq_len=v.seq_len, mixed_precision_param="float32"),  # FSDP's default: bf16
            "parallelism": ParallelismConfig(
                pipeline_parallel_degree=v.pp,
                data_parallel_shard_degree=v.dp_shard,
                data_parallel_replicate_degree=v.dp_replicate,
                tensor_parallel_degree=v.tp,
                context_parallel_degree=v.cp,
            ),
            "compile_config": CompileConfig(enable=v.compile is not None, backend=v.compile or "inductor"),
            "ac_config": None if mode == "none" else policies[mode].Config(),
            "dump_folder": "",
        }

    def models(self, v) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
        """``(shape, whole, reference)``: as :meth:`Titan022.models`, 0.3's model."""
        from torchtitan_seq.titan.flavors import model_shape

        config = self.model_config(v)
        config.update_from_config(config=_JobLike(self.configs(v)["parallelism"]))  # its TP sharding config
        torch.manual_seed(0)
        whole = config.build()
        init_test_weights(whole)
        reference = copy.deepcopy(whole)
        for layer, layer_config in zip(reference.layers.values(), config.layers):
            window = getattr(layer_config.attention, "sliding_window_size", None)  # gpt-oss's windowed layers
            layer.attention.inner_attention = _DenseDocumentAttention03(window)
        return model_shape(config), whole, reference

    def init_weights(self, model: torch.nn.Module) -> None:
        model.init_weights(buffer_device=None)

    def with_float32_experts(self, config) -> None:
        """Make every MoE layer of a 0.3 decoder's ``config`` compute its experts in fp32
        (:func:`_float32_experts`, gpt-oss's :func:`_float32_gpt_oss_experts`), in place."""
        from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

        for layer in config.layers:
            if getattr(layer, "moe", None) is not None:
                gpt_oss = isinstance(layer.moe.routed_experts.inner_experts, GptOssGroupedExperts.Config)
                _use_experts(layer.moe, _float32_gpt_oss_experts() if gpt_oss else _float32_experts())

    def logits(self, model: torch.nn.Module, tokens: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        return model(tokens, attention_masks=documents)

    def cross_entropy_loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The token losses' sum (over TP ranks' vocabulary shards inside a step's SPMD context)."""
        from torchtitan.components.loss import cross_entropy_loss

        return cross_entropy_loss(pred, labels, global_vocab_size=VOCAB)

    def pipeline_chunks(self, whole, args, v):
        """As :meth:`Titan022.pipeline_chunks`: chunks cut and placed as
        :func:`torchtitan_seq.titan.v03.pipeline.pipeline_sequence_llm` does, parallelised by the
        model spec's ``parallelize_fn``."""
        from torchtitan.distributed import pipeline_parallel as titan_pp
        from torchtitan.distributed import utils as dist_utils

        from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
        from torchtitan_seq.titan.cpu_compat import fsdp_for_gloo
        from torchtitan_seq.titan.v03.model import sequence_model_spec
        from torchtitan_seq.titan.v03.pipeline import pipeline_sequence_llm

        configs = self.configs(v)
        dist_utils.set_spmd_backend(configs["parallelism"].spmd_backend)  # as 0.3's trainer does
        dims = _parallel_dims03(v.pp, v.dp_replicate, v.dp_shard, v.cp, v.tp, v.world)
        pp_mesh = dims.get_mesh("pp")
        cls = SEQUENCE_SCHEDULES[v.schedule]
        names = titan_pp._generate_llm_fqn_per_model_part(
            v.pp * v.stages_per_rank // cls.parameter_copies, args.n_layers, 1, 1
        )
        held = cls.place_stages(pp_mesh.size(), len(names))[pp_mesh.get_local_rank()]
        # the family's own (a flavor's spec holds it)
        parallelize_fn = sequence_model_spec(
            v.family.removesuffix("_moe"), "debugmodel", pipeline_sequence_llm
        ).parallelize_fn
        split = [(stage, titan_pp._split_module(whole, names[chunk])) for stage, chunk in held]
        chunk_dims = _chunk_dims03(dims)
        chunks = [
            (stage, len(names), parallelize_fn(chunk, parallel_dims=chunk_dims, **configs)) for stage, chunk in split
        ]
        fsdp_for_gloo([chunk for _, _, chunk in chunks])
        return chunks, dims

    def step_context(self, dims) -> contextlib.AbstractContextManager:
        """0.3's SPMD context (the current mesh of its ``spmd_types`` backend, the chunks'), as its trainer's
        ``train_context`` runs a step."""
        from torchtitan.distributed import utils as dist_utils

        return dist_utils.get_spmd_context(parallel_dims=_chunk_dims03(dims))()


def _config03(seq_len: int, n_layers: int, family: str):
    """0.3's own config of the tiny model of ``family`` (:func:`_llama3_config03`, :func:`_qwen3_config03`,
    :func:`_deepseek_v3_config03`, :func:`_gpt_oss_config03`), its attention backend flex, which
    torchtitan_seq's replaces."""
    if family == "llama3":
        return _llama3_config03(seq_len, n_layers)
    if family == "deepseek_v3":
        return _deepseek_v3_config03(seq_len, n_layers)
    if family == "gpt_oss":
        return _gpt_oss_config03(seq_len, n_layers)
    return _qwen3_config03(seq_len, n_layers, moe=family == "qwen3_moe")


def _llama3_config03(seq_len: int, n_layers: int):
    """0.3's Llama 3 config of the tiny model. ``_build_llama3_layers`` and the initialisers are 0.3's
    private ones, its flavors'."""
    from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=n_layers,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=MULTIPLE_OF),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=seq_len, theta=ROPE_THETA, scaling="none"),
        attn_backend="flex",
    )
    return _decoder_config03(Llama3Model, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init, layers)


def _decoder_config03(model_cls: type, embedding_init: Any, norm_init: Any, output_init: Any, layers: list):
    """The tiny model's config of a 0.3 family built as Llama 3, DeepSeek-V3 and gpt-oss build theirs: the
    family's ``model_cls`` of ``layers``, the embeddings, final norm and output layer initialised by the
    family's own initialisers (``output_init(dim)`` the output layer's)."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return model_cls.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=embedding_init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm_init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=output_init(DIM)),
        layers=layers,
    )


def _qwen3_config03(seq_len: int, n_layers: int, moe: bool):
    """0.3's Qwen3 config of the tiny model, :meth:`Titan022.model_args`' shape: QK-norm, heads of
    ``QWEN3_HEAD_DIM``, untied; ``moe``: every MLP an MoE of 4 experts, 2 routed a token, and one shared
    expert (0.3's MoE flavors have none, its MoE config takes one), its experts in fp32
    (:func:`_float32_experts`). Fused QKV, as 0.3's flavors.
    ``_build_qwen3*_layers``, ``_qwen3_norm`` and the initialisers are 0.3's private ones, its flavors'."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    shape = dict(n_layers=n_layers, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=QWEN3_HEAD_DIM)
    rope = CosSinRoPE.Config(dim=QWEN3_HEAD_DIM, max_seq_len=seq_len, theta=ROPE_THETA)
    if not moe:
        layers = _build_qwen3_layers(**shape, hidden_dim=2 * DIM, attn_backend="flex", rope=rope)
    else:
        layers = _build_qwen3_moe_layers(
            **shape,
            moe_hidden_dim=DIM,
            num_experts=4,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=rope,
        )
        for layer in layers:
            layer.moe.shared_experts = make_ffn_config(
                dim=DIM, hidden_dim=DIM, w1_param_init=_LINEAR_INIT, w2w3_param_init=_LINEAR_INIT
            )
            _use_experts(layer.moe, _float32_experts())
    return Qwen3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=_qwen3_norm(DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=layers,
    )


def _deepseek_v3_config03(seq_len: int, n_layers: int):
    """0.3's DeepSeek-V3 config of the tiny model: MLA as the debug flavor's (no query latent; a key/value
    latent of 16; queries and keys 12 wide a head, 4 of them rotary, values 8), YaRN RoPE with its softmax
    mscale, the first layer dense, then MoE layers of 4 experts, 2 routed a token, and one shared expert,
    the experts in fp32 (:func:`_float32_experts`). ``_build_dsv3_layers`` and the initialisers are 0.3's
    private ones, its flavors'."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
    )

    rope = ComplexRoPE.Config(
        dim=4,
        max_seq_len=seq_len,
        theta=ROPE_THETA,
        scaling="yarn",
        rope_factor=40.0,
        beta_fast=32.0,
        beta_slow=1.0,
        original_seq_len=4096,
    )
    shape = dict(n_layers=n_layers, n_dense_layers=1, dim=DIM, n_heads=HEADS, dense_hidden_dim=2 * DIM)
    mla = dict(q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mscale=0.7)
    moe = dict(moe_hidden_dim=DIM, num_experts=4, num_shared_experts=1, router_top_k=2, router_score_func="softmax")
    backends = dict(attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None)
    layers = _build_dsv3_layers(**shape, **mla, **moe, **backends, rope=rope)
    for layer in layers[1:]:
        _use_experts(layer.moe, _float32_experts())
    return _decoder_config03(DeepSeekV3Model, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init, layers)


def _gpt_oss_config03(seq_len: int, n_layers: int):
    """0.3's gpt-oss config of the tiny model: GQA heads of 8 with a learned sink each, biases, YaRN RoPE,
    a sliding window of ``WINDOW`` on the even layers (as 0.3's flavors window theirs), every MLP an MoE of
    4 experts, 2 routed a token, and one shared expert (gpt-oss has none, 0.3's MoE config takes one), the
    experts in fp32 (:func:`_float32_gpt_oss_experts`). ``_build_gptoss_layers``,
    ``_make_gptoss_attn_config`` and the initialisers are 0.3's private ones, its flavors'."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.gpt_oss import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        GptOssModel,
        _build_gptoss_layers,
        _depth_init,
        _make_gptoss_attn_config,
        _output_linear_init,
    )

    head_dim = 8
    rope = CosSinRoPE.Config(
        dim=head_dim,
        max_seq_len=seq_len,
        theta=150000.0,
        scaling="yarn",
        rope_factor=32,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_seq_len=4096,
    )
    layers = _build_gptoss_layers(
        dim=DIM,
        n_layers=n_layers,
        hidden_dim=DIM,
        num_experts=4,
        top_k=2,
        load_balance_coeff=1e-3,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=rope,
    )
    for layer_id, layer in enumerate(layers):
        # 0.3's layers of its flavors' heads (64 of 64) and window (128), here the tiny model's
        layer.attention = _make_gptoss_attn_config(
            dim=DIM,
            layer_id=layer_id,
            attn_backend="flex",
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            head_dim=head_dim,
            sliding_window_size=WINDOW if layer_id % 2 == 0 else None,
            rope=rope,
        )
        init = _depth_init(layer_id)
        layer.moe.shared_experts = make_ffn_config(dim=DIM, hidden_dim=DIM, w1_param_init=init, w2w3_param_init=init)
        _use_experts(layer.moe, _float32_gpt_oss_experts())
    return _decoder_config03(GptOssModel, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init, layers)


def _use_experts(moe, experts_cls: type) -> None:
    """Make an MoE config's routed experts ``experts_cls``'s, of the same fields."""
    experts = moe.routed_experts.inner_experts
    fields = {f.name: getattr(experts, f.name) for f in dataclasses.fields(experts) if f.init}
    moe.routed_experts.inner_experts = experts_cls.Config(**fields)


@functools.cache
def _parallel_dims03(pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, world: int):
    """0.3's ``ParallelDims`` of the degrees, its mesh built, one per degrees in a rank's process.

    Variants of the same degrees share it: 0.3's FSDP under its ``spmd_types`` backend finds a
    parameter's storage mesh equal to, but not the same object as, the mesh it shards over where a
    second ``ParallelDims`` of the same degrees builds its meshes again ("Expected param's DTensor
    mesh to be the same mesh passed to fully_shard").
    """
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp,
        data_parallel_replicate_degree=dp_replicate,
        data_parallel_shard_degree=dp_shard,
        context_parallel_degree=cp,
        tensor_parallel_degree=tp,
    )
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    return dims


def _chunk_dims03(dims):
    """The degrees :func:`torchtitan_seq.titan.v03.pipeline.chunk_parallel_dims` gives the chunks of a job of
    ``dims``' (the CP ranks as FSDP's), as :func:`_parallel_dims03`'s ``ParallelDims``: one per degrees in a
    rank's process, whatever the variant (an FSDP2 variant's degrees are a CP variant's chunks')."""
    p = dims
    return _parallel_dims03(p.pp, p.dp_replicate, p.dp_shard * p.cp, 1, p.tp, p.world_size)


@functools.cache
def _float32_experts() -> type:
    """0.3's grouped experts computing in their parameters' dtype, for the tiny MoE.

    0.3's ``GroupedExperts`` casts its input and weights to bf16 for its grouped GEMMs whatever their
    dtype, so each unit's share of an expert's weight gradient is rounded to bf16 on its own, where the
    whole sequence's is rounded once: some 4e-3 apart, above the harness's fp32 tolerance. These run
    the same grouped GEMMs (``torch._grouped_mm``, on the same routing) in fp32.
    """
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    class Float32GroupedExperts(GroupedExperts):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            # local weights under TP, as 0.3's forward takes them
            w1, w2, w3 = (
                w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
            )
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)

    return Float32GroupedExperts


@functools.cache
def _float32_gpt_oss_experts() -> type:
    """0.3's gpt-oss experts computing in their parameters' dtype, for the tiny model: as
    :func:`_float32_experts`, gpt-oss's own casting its grouped GEMMs' inputs to bf16. The same maths
    (``torch._grouped_mm``, biases per token, gpt-oss's clamped SwiGLU) in fp32, the output bias a TP
    rank's share (its partial sums are summed over the TP ranks) in forward and backward alike: gpt-oss's
    own ``ScaleBiasForward`` shares it in forward only, so under 0.3's spmd_types backend, which sums its
    gradient over the TP ranks, the bias's gradient would come out TP times the whole sequence's."""
    from torch.distributed.tensor import DTensor
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, swiglu

    class Float32GptOssGroupedExperts(GptOssGroupedExperts):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GptOssGroupedExperts.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.width = 2 * config.hidden_dim  # mlp1's, whole

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            params = (self.mlp1_weight_EGD, self.mlp1_bias_EG, self.mlp2_weight_EDF, self.mlp2_bias_ED)
            w1, b1, w2, b2 = (p.to_local() if isinstance(p, DTensor) else p for p in params)
            # The TP degree by mlp1's local width: under 0.3's spmd_types backend the parameters are local
            # tensors, not the DTensors in which gpt-oss's own forward looks for the TP mesh.
            tp = self.width // w1.shape[1]
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            # each row's expert, found without reading the counts on the host; rows past the routed ones
            # (padding) get no bias, as gpt-oss's own forward gives them
            positions = torch.arange(x_RD.shape[0], device=x_RD.device, dtype=offsets.dtype)
            expert = torch.searchsorted(offsets, positions, right=True)

            def bias(b: torch.Tensor) -> torch.Tensor:
                return torch.cat([b, b.new_zeros(1, b.shape[-1])])[expert]

            h = torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offsets) + bias(b1)
            h = torch._grouped_mm(swiglu(h, limit=self.swiglu_limit), w2.transpose(-2, -1), offs=offsets)
            return h + bias(b2) / tp

    return Float32GptOssGroupedExperts


class _JobLike:
    """What 0.3's ``Decoder.Config.update_from_config`` reads of a job besides a trainer's: its
    ``parallelism``."""

    def __init__(self, parallelism) -> None:
        self.parallelism = parallelism


TITAN: Titan022 | Titan03 = Titan03() if TITAN_03 else Titan022()
"""The installed torchtitan's adapter."""


@torch.no_grad()
def init_test_weights(model: torch.nn.Module) -> None:
    """Weights under which every parameter's gradient is far above fp32 round-off.

    torchtitan's initialisation (std 0.02) leaves this small model's attention
    nearly uniform: the largest gradient of some wq, wk and norm weights is
    then under 1e-5, and a wholly wrong gradient hides in round-off. Matrices
    drawn with std 0.1 make attention depend on the keys; every gradient is
    then above ``harness.GRAD_FLOOR`` (sharper attention, std 0.3, would raise
    round-off to 5e-6 of a gradient's scale). ``model``, the installed version's, is initialised first
    as that version does it.
    """
    TITAN.init_weights(model)
    for p in model.parameters():
        if p.dim() >= 2:  # matrices, and an MoE's experts' stacked matrices
            p.normal_(0.0, 0.1)
