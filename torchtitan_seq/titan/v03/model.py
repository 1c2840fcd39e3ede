"""torchtitan 0.3's decoder families with chunk-aware attention: the models the sequence schedules run there.

0.3 builds a model from configs, and every decoder family (``torchtitan.models.<family>``, a
``Decoder`` subclass) takes its attention's inner attention as a config of its own
(``<Attention>.Config.inner_attention``), called as ``(q, k, v, attention_masks=, scale=, enable_gqa=)``
in (B, L, heads, head_dim) layout after QK-norm and RoPE: Llama 3's and Qwen3's grouped-query attention,
DeepSeek-V3's multi-head latent attention (keys and queries 192 wide with the decoupled RoPE part, values
128, in the debug flavor) and gpt-oss's (a sliding window on every other layer, named by the layer's
``sliding_window_size``, and a learned sink a head, which it hands the inner attention as
``out_transform``). :class:`SeqInnerAttention` is that plug, a
:class:`~torchtitan_seq.attention.SequenceAttention` of the layer's reach, the sinks read from the layer
itself. :func:`sequence_model_config` swaps it into every layer of a family's config
(:func:`sequence_model_spec`: a flavor of its ``model_registry``), so parameters, FQNs, initialisation, TP
plan, MoE layers and checkpoints stay the family's, and builds the model as the family's class from
:func:`sequence_model_class`: while a pipeline stage runs a unit at offset s, it reads RoPE at positions
[s, s+L) (DeepSeek-V3's YaRN on its decoupled part alike; a CP rank at its share's). 0.3's MoE layers run
their experts as ``torch._grouped_mm`` in bf16, which torch implements on the CPU too (no Triton), so
nothing changes there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.deepseek_v3 import deepseekv3_configs
from torchtitan.models.gpt_oss import gptoss_configs
from torchtitan.models.gpt_oss.model import Attention as GptOssAttention
from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.runtime.kv_context import KVContext
from torchtitan_seq.runtime.reach import FULL, Reach
from torchtitan_seq.runtime.rope import UnitPositions
from torchtitan_seq.titan.mla_latent import mla_latent

__all__ = [
    "SeqInnerAttention",
    "SeqFlavor",
    "FLAVORS",
    "SEQUENCE_MODELS",
    "family_of",
    "sequence_model_class",
    "sequence_model_config",
    "sequence_model_spec",
    "seq_llama3",
]


class SeqInnerAttention(Module, SequenceAttention):
    """0.3's inner attention (q, k, v as (B, L, heads, head_dim), out the same) that runs
    :class:`~torchtitan_seq.attention.SequenceAttention`: causal within the layer's reach, or block-causal
    given a packed batch's (B, L) document ids as ``attention_masks``; gpt-oss's sinks merged in."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        layer_id: int
        """The layer's index: names its slab in a stage's KV context."""
        reach: Reach = FULL
        """How far back the layer's queries read (gpt-oss's sliding window)."""

    def __init__(self, config: Config) -> None:
        """The inner attention of layer ``config.layer_id``.

        Args:
            config: its config.
        """
        SequenceAttention.__init__(self, config.layer_id, config.reach)

    # 0.3's argument names: its sharding config (local_map under TP) maps them to placements.
    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        out_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention over the unit the stage's KV context runs, or over the whole sequence outside a unit.

        Args:
            q_BLNH: (B, L, Hq, D) queries, post-RoPE.
            k_BLNH: (B, L, Hkv, D) keys, post-RoPE, before GQA expansion.
            v_BLNH: (B, L, Hkv, Dv) values, before GQA expansion (Dv: MLA's narrower than D).
            attention_masks: None (causal) or (B, L) document ids (block-causal).
            scale: the softmax scale; None: D ** -0.5.
            enable_gqa: SDPA's, on the unbound causal path; units take grouped K/V heads as they are.
            is_causal: must be True for a unit and for packed documents.
            out_transform: gpt-oss's sink rescaling (its attention's ``_apply_sinks``), whose sinks are
                merged through the log-sum-exp of every key a query reads (:func:`attention_sinks`).

        Returns:
            (B, L, Hq, Dv) attention output.
        """
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # to SequenceAttention's B, N, L, H
        out = SequenceAttention.forward(
            self,
            q,
            k,
            v,
            scale=scale,
            enable_gqa=enable_gqa,
            is_causal=is_causal,
            documents=attention_masks,
            sinks=None if out_transform is None else attention_sinks(out_transform),
        )
        return out.transpose(1, 2)


def attention_sinks(out_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The sinks of the one ``out_transform`` 0.3's attention hands its inner attention: gpt-oss's
    ``Attention._apply_sinks``, ``out * sigmoid(lse - sinks)`` of the layer's own sinks. A unit's output
    is merged over its prefix and its own keys, so the sinks are handed to the merge, not applied to a
    part of it.

    Args:
        out_transform: the attention's bound ``_apply_sinks``.

    Returns:
        (Hq,) the layer's sinks (this rank's heads under TP, their gradient the DTensor's shard).

    Raises:
        TypeError: ``out_transform`` is not gpt-oss's sink rescaling.
    """
    # gpt-oss's attention hands its inner attention no other out_transform than its sink rescaling
    if not isinstance(getattr(out_transform, "__self__", None), GptOssAttention):
        raise TypeError(f"out_transform {out_transform!r}: chunk-aware attention merges gpt-oss's sinks only")
    sinks = out_transform.__self__.sinks
    # as gpt-oss reads them: under TP the local heads' sinks, q, k and v being local inside local_map
    return sinks.to_local(grad_placements=sinks.placements) if isinstance(sinks, DTensor) else sinks


class _SequenceDecoder(Decoder):
    """Mixed before a family's model class; see :func:`sequence_model_class`."""

    def __init__(self, config: Decoder.Config) -> None:
        super().__init__(config)
        self.kv_context: KVContext | None = None
        self._positions = UnitPositions()
        for layer in self.layers.values():  # an MLA layer's latent, read under kv_context = "latent"
            layer.attention.inner_attention.latent = mla_latent(layer.attention)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """0.3's forward, with RoPE at the unit's positions while a pipeline stage runs a unit.

        Args:
            tokens: (B, L) ids on the first stage, else (B, L, dim) activations.
            positions: RoPE positions; None: the running unit's (:class:`UnitPositions`), or the model's
                own outside a unit.
            attention_masks: None (causal) or (B, L) document ids (block-causal).

        Returns:
            (B, L, vocab) logits on the last stage, else (B, L, dim) activations; contiguous.
        """
        if positions is None:
            positions = self._positions.of(self.kv_context, tokens.device)
        # Under 0.3's sequence parallelism (TP) a stage's output, (B, L, dim) sharded on L, is a view that is
        # not contiguous once a microbatch holds more than one row; torch's stage sends it as it is, and gloo
        # refuses ("input tensor has to be contiguous"). A no-op on a contiguous output.
        return super().forward(tokens, positions, attention_masks).contiguous()


@functools.cache
def sequence_model_class(model_cls: type[Decoder]) -> type[Decoder]:
    """A torchtitan 0.3 decoder family's class whose attention can run one (microbatch, subsequence) unit
    at a time (its layers' inner attention a :class:`SeqInnerAttention`, as its config says).

    Args:
        model_cls: the family's model class (``Llama3Model``, ``Qwen3Model``, ...).

    Returns:
        Its subclass ``Seq<name>`` (one per class), built from its ``Config``: the family's with
        ``block_causal`` (packed documents: attention stops at each EOS, the trainer passes document
        ids), which 0.3 wires to the subclass (``Configurable.__init_subclass__``).
    """
    name = f"Seq{model_cls.__name__}"

    @dataclass(kw_only=True, slots=True)
    class Config(model_cls.Config):
        block_causal: bool = False
        """Packed documents: attention stops at each EOS (the trainer passes document ids)."""

    Config.__qualname__ = f"{name}.Config"
    namespace = {
        "Config": Config,
        "__module__": __name__,
        "__doc__": f"{model_cls.__name__} with chunk-aware attention.",
    }
    return type(name, (_SequenceDecoder, model_cls), namespace)


class SeqFlavor(NamedTuple):
    """A flavor the sequence schedules run: which of the family's flavors, and how it differs."""

    base: str
    """The flavor of the family's ``model_registry``."""
    block_causal: bool = False
    """Whether attention is block-causal (packed documents)."""
    untied: bool = False
    """The base flavor ties its output layer to its embeddings, which 0.3 does not pipeline: this one has
    embeddings of their own, drawn as the base draws the shared weight (its output layer's init)."""


FLAVORS: dict[str, dict[str, SeqFlavor]] = {
    "llama3": {
        "debugmodel": SeqFlavor("debugmodel"),
        "debugmodel_flex_attn": SeqFlavor("debugmodel", block_causal=True),
        "8B": SeqFlavor("8B"),
        "8B_flex": SeqFlavor("8B", block_causal=True),
        "debugmodel_varlen_attn": SeqFlavor("debugmodel", block_causal=True),
        "8B_varlen": SeqFlavor("8B", block_causal=True),
        "70B": SeqFlavor("70B"),
        "405B": SeqFlavor("405B"),
    },
    "qwen3": {
        **{flavor: SeqFlavor(flavor) for flavor in qwen3_configs},
        "debugmodel_untied": SeqFlavor("debugmodel", untied=True),
    },
    "deepseek_v3": {flavor: SeqFlavor(flavor) for flavor in deepseekv3_configs},
    "gpt_oss": {flavor: SeqFlavor(flavor) for flavor in gptoss_configs},
}
"""Per family (``torchtitan.models.<family>``), its flavors by name. Llama 3's are 0.2.2's names (as the
shipped configs, the planner and :mod:`torchtitan_seq.titan.flavors` name them), block-causal where
0.2.2's flex and varlen flavors are; Qwen3's, DeepSeek-V3's (without multi-token prediction, which 0.3
does not pipeline) and gpt-oss's are 0.3's, and Qwen3's dense debug model untied."""

SEQUENCE_MODELS: tuple[str, ...] = tuple(f"{family}_seq" for family in FLAVORS)
"""The model names of :func:`sequence_model_spec`'s specs: ``<family>_seq``. A family's own spec (named
``<family>``) has no chunk-aware attention."""


def family_of(model_name: str) -> str | None:
    """The family of a model spec's name.

    Args:
        model_name: ``ModelSpec.name``.

    Returns:
        The family (a key of :data:`FLAVORS`) of a name of :data:`SEQUENCE_MODELS`, else None.
    """
    family = model_name.removesuffix("_seq")
    return family if model_name in SEQUENCE_MODELS else None


def sequence_model_config(base: Decoder.Config, *, block_causal: bool = False, untied: bool = False) -> Decoder.Config:
    """A decoder family's model config with :class:`SeqInnerAttention` in every layer, of the layer's reach
    (the layers' configs changed in place), as the config of :func:`sequence_model_class`'s class.

    Args:
        base: the family's config (``<Family>Model.Config``), e.g. a flavor's.
        block_causal: whether attention is block-causal (packed documents).
        untied: give the embeddings a weight of their own where ``base`` ties them to the output layer,
            drawn as the output layer's (the shared weight's init).

    Returns:
        The config, which builds the family's model with chunk-aware attention.

    Raises:
        ValueError: ``base`` has multi-token prediction layers (DeepSeek-V3's), which 0.3 does not pipeline.
    """
    # the family's model class: the one of its module that ``base`` configures
    module = sys.modules[type(base).__module__]
    model_cls = next(
        c for c in vars(module).values() if isinstance(c, type) and getattr(c, "Config", None) is type(base)
    )
    if getattr(base, "mtp_layers", None):
        raise ValueError(
            "multi-token prediction layers: torchtitan 0.3 does not pipeline them; build the flavor without"
        )
    for layer_id, layer in enumerate(base.layers):
        # gpt-oss's windowed layers name their window (torchtitan's sliding-window mask's)
        reach = Reach(window=getattr(layer.attention, "sliding_window_size", None))
        layer.attention.inner_attention = SeqInnerAttention.Config(layer_id=layer_id, reach=reach)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    if untied:
        embedding_init = {"weight": base.lm_head.param_init["weight"]}
        embeddings = dataclasses.replace(base.tok_embeddings, param_init=embedding_init)
        fields.update(enable_weight_tying=False, tok_embeddings=embeddings)
    return sequence_model_class(model_cls).Config(**fields, block_causal=block_causal)


def sequence_model_spec(family: str, flavor: str, pipelining_fn: Callable[..., Any]) -> ModelSpec:
    """0.3's model spec of a family's flavor, with chunk-aware attention, under the name ``<family>_seq``.

    Args:
        family: a key of :data:`FLAVORS` (``torchtitan.models.<family>``).
        flavor: a key of the family's :data:`FLAVORS`.
        pipelining_fn: the spec's pipelining function, e.g.
            :func:`~torchtitan_seq.titan.v03.pipeline.pipeline_sequence_llm`.

    Returns:
        The family's spec of the base flavor (its parallelisation, optimizer hook and checkpoint adapter)
        with :func:`sequence_model_config`'s model (block-causal and untied as :data:`FLAVORS` says),
        pipelined by ``pipelining_fn``.
    """
    seq_flavor = FLAVORS[family][flavor]
    spec = importlib.import_module(f"torchtitan.models.{family}").model_registry(seq_flavor.base)
    # its inner attention (flex) replaced
    model = sequence_model_config(spec.model, block_causal=seq_flavor.block_causal, untied=seq_flavor.untied)
    return dataclasses.replace(spec, name=f"{family}_seq", flavor=flavor, model=model, pipelining_fn=pipelining_fn)


def seq_llama3(flavor: str, pipelining_fn: Callable[..., Any]) -> ModelSpec:
    """0.3's Llama 3 model spec of a flavor, with chunk-aware attention, under the name ``llama3_seq``.

    Args:
        flavor: a key of Llama 3's :data:`FLAVORS` (0.2.2's flavor names).
        pipelining_fn: the spec's pipelining function.

    Returns:
        :func:`sequence_model_spec` of Llama 3's ``flavor``.
    """
    return sequence_model_spec("llama3", flavor, pipelining_fn)
