"""Activations: the bytes a unit's tokens save for backward on a chunk, per activation checkpointing mode
(notation: the package's docstring).

**Activations** (what autograd saves for backward, the figure
:class:`torchtitan_seq.instrumentation.memory.ActivationMemory` measures). Per token and layer, as
torchtitan's ``TransformerBlock`` saves it with the project's attention (autograd's saved tensors,
as counted on the CPU):

* ``none``: each RMSNorm's input (the block input x, and h = x + attention; D/t each under
  sequence parallel) and 1/rms, aD/t + 4/t per norm with CUDA's fused kernel, 8D/t + 4/t
  with the CPU's composite form (it keeps x upcast to float32 and x/rms, both float32);
  the normed inputs of the attention and MLP projections, gathered to whole tokens under
  TP, 2aD; q, the attention output (the output projection saves the same storage), K and
  V, the MLP's w1 and w3 outputs, SiLU's output and their product, a (2 H hd + 2 Hkv hd + 4F) / t
  (H hd = D in Llama 3; MLA: q and K H x 192, the output and V H x 128 in the 671B); the
  log-sum-exp, 4H/t; for a unit, its RoPE rows (hd/2 complex64, 4 hd; MLA: its rope part). The
  whole RoPE table (4 S hd) is saved once per stage where layers get it whole: torch's schedules,
  and checkpointed blocks (an input). F is the width a token runs through, averaged over the layers
  (an MoE layer's ``top_k`` routed and shared experts); an MoE layer adds the token's routed copies
  (the experts' inputs and outputs, 2 a top_k D) and MLA its latents (:func:`family_bytes`).
* ``full`` (every block checkpointed): the block input, aD/t; units add their positions
  (8 bytes a token, once per stage).
* ``selective`` with ``selective_ac_option = "op"``: the input plus what torchtitan's op
  list keeps: the outputs of every other matmul (wq, wv, w1, w2) and of TP's
  reduce-scatter: a (H hd + D + Hkv hd + F) / t + aD (w2's output, before its reduce-scatter
  under TP, plus aD/t after it when t > 1). The unit attention op is not in the list, so
  it is recomputed and the KV context keeps K/V (:mod:`.stage_bytes`). Not measurable with
  ``ActivationMemory`` (selective checkpointing's cache bypasses saved-tensor hooks).
* ``selective`` with an integer option n: every n-th block checkpointed: 1/n of the
  layers at ``full``'s bytes, the rest at ``none``'s.

Stages add: the first, the token ids (8 bytes a token); the last, the final norm, its
gathered output (aD, the output projection's input) and the loss's log-softmax in
float32 with the labels (4V/t + 8). A unit of stage s holds b L_j times its chunk's
per-token bytes from its forward until its backward (B, or W where backward is split).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_seq.runtime.model_counts import head_widths, kv_values, mlp_width, moe_share, rope_width
from torchtitan_seq.simulate.memory.config import MemoryConfig

if TYPE_CHECKING:  # torchtitan is imported where a flavor is looked up, not with this module
    from torchtitan.models.llama3 import TransformerModelArgs


def recomputed_fraction(c: MemoryConfig) -> float:
    """Share of layers whose forward is recomputed in backward (their K/V kept by the context)."""
    if c.activation_checkpoint == "none":
        return 0.0
    if c.activation_checkpoint == "selective" and c.selective_ac_option != "op":
        return 1 / int(c.selective_ac_option)
    return 1.0


def layer_bytes(args: TransformerModelArgs, c: MemoryConfig, a: int, mode: str, unit: bool) -> float:
    """Saved bytes per token of one transformer layer, ``mode`` 'none', 'full' or 'op'."""
    d, t, f = args.dim, c.tp, mlp_width(args)
    kv, (q, out) = kv_values(args), head_widths(args)
    if mode == "full":
        return a * d / t
    if mode == "op":  # wq's, wv's, w1's and w2's outputs
        return a * (q + d + kv // 2 + f) / t + a * d + (a * d / t if t > 1 else 0)
    norms = 2 * norm_bytes(args, c, a)  # attention_norm's input x, ffn_norm's h
    gathered = 2 * a * d  # the attention and MLP projections' input, whole tokens under TP
    body = a * (q + out + kv + 4 * f) / t  # q, attention output, K, V; w1, w3, SiLU, product
    lse = 4 * args.n_heads / t
    rope = 4 * rope_width(args) if unit else 0  # the unit's RoPE rows, complex64
    return norms + gathered + body + lse + rope + family_bytes(args, a)


def family_bytes(args: TransformerModelArgs, a: int) -> float:
    """What a family's own parts save per token and layer beyond a Llama 3 layer's, whole tokens: an MoE
    layer's routed copies of the token (the experts' inputs and outputs, ``top_k`` of each; averaged over
    the layers), MLA's latents (:attr:`~torchtitan_seq.runtime.layer_shapes.MLAShape.latent_width`)."""
    extra = 0.0
    if (moe := getattr(args, "moe", None)) is not None:
        extra += 2 * a * moe.top_k * args.dim * moe_share(args)
    if (mla := getattr(args, "mla", None)) is not None:
        extra += a * mla.latent_width
    return extra


def norm_bytes(args: TransformerModelArgs, c: MemoryConfig, a: int) -> float:
    """What one RMSNorm saves per token: on CUDA torch's fused kernel keeps its input and
    1/rms (float32); on the CPU the composite form keeps the input upcast to float32,
    1/rms and x/rms, all float32."""
    d, t = args.dim, c.tp
    return (a * d / t if c.device == "cuda" else 8 * d / t) + 4 / t


def saved_per_token(
    args: TransformerModelArgs, c: MemoryConfig, a: int, layers: float, first: bool, last: bool, unit: bool
) -> float:
    """Saved bytes per token of a unit on a chunk of ``layers`` layers (see the module docstring)."""
    mode = c.activation_checkpoint
    if mode == "none":
        per_layer = layer_bytes(args, c, a, "none", unit)
    elif mode == "full" or c.selective_ac_option == "op":
        per_layer = layer_bytes(args, c, a, "full" if mode == "full" else "op", unit)
    else:
        n = int(c.selective_ac_option)
        per_layer = (layer_bytes(args, c, a, "full", unit) + (n - 1) * layer_bytes(args, c, a, "none", unit)) / n
    out = layers * per_layer
    if unit and mode != "none" and layers:
        out += 8  # positions, a checkpoint input
    if first:
        out += 8  # token ids
    if last:
        out += norm_bytes(args, c, a) + a * args.dim + 4 * args.vocab_size / c.tp + 8
    return out
