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
  V, the MLP's w1 and w3 outputs, SiLU's output and their product, a (2D + 2 Hkv hd + 4F) / t;
  the log-sum-exp, 4H/t; for a unit, its RoPE rows (hd/2 complex64, 4 hd). The whole RoPE
  table (4 S hd) is saved once per stage where layers get it whole: torch's schedules, and
  checkpointed blocks (an input).
* ``full`` (every block checkpointed): the block input, aD/t; units add their positions
  (8 bytes a token, once per stage).
* ``selective`` with ``selective_ac_option = "op"``: the input plus what torchtitan's op
  list keeps: the outputs of every other matmul (wq, wv, w1, w2) and of TP's
  reduce-scatter: a (2D + Hkv hd + F) / t + aD (w2's output, before its reduce-scatter
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

from torchtitan_seq.runtime.partition import ffn_hidden_dim
from torchtitan_seq.simulate.memory.config import MemoryConfig

if TYPE_CHECKING:  # torchtitan is imported where a flavor is looked up, not with this module
    from torchtitan.models.llama3 import TransformerModelArgs


def kv_width(args: TransformerModelArgs) -> int:
    """Hkv hd: K (or V) values per token and layer."""
    return (args.n_kv_heads or args.n_heads) * (args.dim // args.n_heads)


def recomputed_fraction(c: MemoryConfig) -> float:
    """Share of layers whose forward is recomputed in backward (their K/V kept by the context)."""
    if c.activation_checkpoint == "none":
        return 0.0
    if c.activation_checkpoint == "selective" and c.selective_ac_option != "op":
        return 1 / int(c.selective_ac_option)
    return 1.0


def layer_bytes(args: TransformerModelArgs, c: MemoryConfig, a: int, mode: str, unit: bool) -> float:
    """Saved bytes per token of one transformer layer, ``mode`` 'none', 'full' or 'op'."""
    d, t, f = args.dim, c.tp, ffn_hidden_dim(args)
    kv = kv_width(args)
    if mode == "full":
        return a * d / t
    if mode == "op":
        return a * (2 * d + kv + f) / t + a * d + (a * d / t if t > 1 else 0)
    norms = 2 * norm_bytes(args, c, a)  # attention_norm's input x, ffn_norm's h
    gathered = 2 * a * d  # the attention and MLP projections' input, whole tokens under TP
    body = a * (2 * d + 2 * kv + 4 * f) / t  # q, attention output, K, V; w1, w3, SiLU, product
    lse = 4 * args.n_heads / t
    rope = 4 * (d // args.n_heads) if unit else 0  # the unit's RoPE rows, complex64
    return norms + gathered + body + lse + rope


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
