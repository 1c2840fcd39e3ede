"""How a model family's layers differ from Llama 3's, as the cost models read them: mixture-of-experts MLPs
(:class:`MoEShape`), multi-head latent attention (:class:`MLAShape`) and attention that reads fewer keys
than the whole causal prefix (:class:`AttentionReach`). Plain numbers: the family tables
(:mod:`torchtitan_seq.titan.flavors`) fill them, the unit cost and the memory model read them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoEShape", "MLAShape", "AttentionReach"]


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts MLP of a family (torchtitan's ``MoEArgs`` and where the MoE layers are)."""

    experts: int
    """Routed experts of an MoE layer (``num_experts``)."""
    top_k: int
    """Routed experts each token runs through."""
    width: int
    """Hidden width of one expert, routed or shared (``moe_inter_dim``)."""
    shared_experts: int = 0
    """Experts every token runs through (``num_shared_experts``): one MLP of ``shared_experts x width``."""
    dense_layers: int = 0
    """Leading layers with a dense MLP (DeepSeek-V3's ``n_dense_layers``)."""
    every: int = 1
    """Past the leading dense layers, layer i is an MoE layer where (i + 1) is a multiple of it (Llama 4's
    ``interleave_moe_layer_step``); the others are dense."""

    @property
    def active_width(self) -> int:
        """Hidden width a token runs through in an MoE layer: its ``top_k`` routed experts and the shared ones."""
        return (self.top_k + self.shared_experts) * self.width

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has the MoE MLP."""
        return layer >= self.dense_layers and (layer + 1) % self.every == 0

    def moe_layers(self, n_layers: int) -> int:
        """MoE layers of a model of ``n_layers`` layers: the multiples of ``every`` in (dense_layers, n_layers]
        (the cost models ask it per layer's bytes, so it is counted, not walked)."""
        return max(n_layers // self.every - self.dense_layers // self.every, 0)

    def expert_weights(self, dim: int, active: bool) -> int:
        """Matrix weights of an MoE layer's experts (w1, w2, w3 each): every expert's, or (``active``) those
        a token runs through."""
        routed = self.top_k if active else self.experts
        return 3 * dim * self.width * (routed + self.shared_experts)


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek-V3's): queries and keys/values projected through low-rank
    latents; a head's query and key are ``qk_nope_head_dim + qk_rope_head_dim`` wide, its value
    ``v_head_dim``."""

    q_lora_rank: int
    """Rank of the query latent; 0: queries projected straight from the model width."""
    kv_lora_rank: int
    """Rank of the key/value latent."""
    qk_nope_head_dim: int
    """Per head, the query/key part without rotary embedding."""
    qk_rope_head_dim: int
    """Per head, the query/key part with rotary embedding (one shared key part per token)."""
    v_head_dim: int
    """Per head, the value width."""

    @property
    def qk_head_dim(self) -> int:
        """Width of a head's query and key."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def projection_weights(self, dim: int, n_heads: int) -> int:
        """Matrix weights of one layer's attention projections (wq or wq_a and wq_b, wkv_a, wkv_b, wo)."""
        q_out = n_heads * self.qk_head_dim
        q = dim * q_out if self.q_lora_rank == 0 else self.q_lora_rank * (dim + q_out)
        kv = dim * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n_heads * self.v_head_dim * dim

    @property
    def norm_weights(self) -> int:
        """Weights of the latents' RMSNorms (kv_norm, and q_norm where queries have a latent)."""
        return self.kv_lora_rank + self.q_lora_rank

    @property
    def latent_width(self) -> int:
        """Values a token's latents hold in one layer (wkv_a's output and its normed latent; wq_a's and
        its normed one): what the layer saves for backward beyond its heads."""
        return 2 * self.kv_lora_rank + self.qk_rope_head_dim + 2 * self.q_lora_rank


@dataclass(frozen=True)
class AttentionReach:
    """Which layers' queries read fewer keys than their whole causal prefix, and how many: gpt-oss's
    sliding window on every other layer, Llama 4's chunked attention on its RoPE layers. Layer i reads the
    whole prefix where i % ``period`` == ``global_phase``; the others are *bounded*."""

    window: int | None = None
    """Sliding window: a bounded layer's query reads at most this many keys (its own included)."""
    chunk: int | None = None
    """Chunked attention: a bounded layer's query reads the keys of its own block of this many tokens."""
    period: int = 1
    """Layers repeat their reach every ``period`` layers."""
    global_phase: int = 0
    """The layer of each period that reads the whole prefix."""

    def __post_init__(self) -> None:
        if (self.window is None) == (self.chunk is None):
            raise ValueError(f"attention reach: give a window or a chunk, not {self.window} and {self.chunk}")

    def bounded_layers(self, n_layers: int) -> int:
        """Bounded layers of a model of ``n_layers`` layers: all but those at ``global_phase`` of a period."""
        return n_layers - max(-(-(n_layers - self.global_phase) // self.period), 0)

    def pairs(self, length: float, prefix: float) -> float:
        """(query, key) pairs a bounded layer scores for ``length`` queries after ``prefix`` tokens: the
        integral over the queries' positions p of the keys each reads, min(p, window) or p mod chunk (the
        unit cost's causal count, p, capped)."""
        return self._keys_before(prefix + length) - self._keys_before(prefix)

    def _keys_before(self, end: float) -> float:
        """The integral of the keys a query at p reads, over p in [0, end)."""
        if self.window is not None:
            w = self.window
            return end * end / 2 if end <= w else w * w / 2 + (end - w) * w
        c = self.chunk
        blocks, rest = divmod(end, c)
        return blocks * c * c / 2 + rest * rest / 2
