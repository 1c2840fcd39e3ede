"""MLA's latent as a layer's K/V context (``kv_context = "latent"``): per microbatch, the compressed
latent and decoupled RoPE key of the positions later units read, not their expanded keys and values.

Multi-head latent attention (DeepSeek-V3's) computes per token a latent c = kv_norm(wkv_a(x)[:r])
(r = ``kv_lora_rank``) and a RoPE key part k_pe (``qk_rope_head_dim`` wide, shared by the heads), and
expands them per head into keys [wkv_b(c)_nope, k_pe] and values wkv_b(c)_v. A :class:`LatentSlab`
keeps (c, k_pe) of each earlier unit, r + rope values a token and layer where a K/V slab keeps
H x (qk_head_dim + v_head_dim); a unit expands its prefix from it inside its own autograd graph
(:mod:`torchtitan_seq.attention.latent`), so wkv_b's gradient is the unit's own, and sends the gradient of
the prefix's latent into the slab's gradient, which each earlier unit's backward adds to the gradient of
its own latent once, as a K/V slab's gradient reaches its keys (:mod:`torchtitan_seq.runtime.kv_slab`).

A slab lies in memory of its own (no arena): it lives from its microbatch's first forward to its last
backward on the stage, as a K/V slab of bounded reach does (:mod:`torchtitan_seq.runtime.kv_reach`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LatentSlab", "LatentSlabs"]


class LatentSlab:
    """The latent and RoPE key of one microbatch in one MLA layer, and the gradient later units send them.

    ``values``: (B, size, r + rope), each position's normed latent then its RoPE key, positions
    [0, ``filled``) written so far (units 0..j in order), in position order. ``grad``: its gradient, laid
    out alike; None until the first later unit sends one.

    Args:
        latent: a unit's normed latent (B, L, r), whose batch, width and dtype the slab takes.
        rope: its RoPE key part (B, L, rope).
        size: positions to hold (the keys later units read; 0 with a slab that grows).
    """

    __slots__ = ("values", "rank", "filled", "grad")

    def __init__(self, latent: Tensor, rope: Tensor, size: int) -> None:
        self.rank = latent.shape[-1]
        self.values = latent.new_empty(latent.shape[0], size, self.rank + rope.shape[-1])
        self.filled = 0
        self.grad: Tensor | None = None

    def write(self, offset: int, latent: Tensor, rope: Tensor) -> None:
        """Write a unit's latent (B, L, r) and RoPE key (B, L, rope) at positions [offset, offset + L)."""
        stop = offset + latent.shape[1]
        if stop > self.values.shape[1]:  # a context told no lengths grows the slab (copies the prefix)
            grown = self.values.new_empty(self.values.shape[0], stop, self.values.shape[2])
            grown[:, : self.filled] = self.values[:, : self.filled]
            self.values = grown
        into = self.values[:, offset:stop]
        into[..., : self.rank].copy_(latent.detach())
        into[..., self.rank :].copy_(rope.detach())
        self.filled = stop

    def prefix(self, stop: int) -> tuple[Tensor, Tensor]:
        """The latent (B, stop, r) and RoPE key (B, stop, rope) of positions [0, stop): aliases with a version
        counter of their own, since later units write other positions, which autograd would otherwise take for
        a change of what the reading unit saved."""
        values = self.values[:, :stop]
        return values[..., : self.rank].data, values[..., self.rank :].data

    def accumulate(self, grad_latent: Tensor | None, grad_rope: Tensor | None) -> None:
        """Add the gradient a later unit sends the latent (B, n, r) and RoPE key (B, n, rope) of positions
        [0, n), in place (None: none sent to that part)."""
        if grad_latent is None and grad_rope is None:
            return
        part = grad_latent if grad_latent is not None else grad_rope
        n = part.shape[1]
        if n == 0:
            return
        if grad_latent is None or grad_rope is None:  # a part the unit's graph left unread: zeros
            shape = (part.shape[0], n, self.values.shape[2] - part.shape[2])
            grad_latent, grad_rope = (
                (part, part.new_zeros(shape)) if grad_rope is None else (part.new_zeros(shape), part)
            )
        if self.grad is None:  # once per microbatch and layer
            if n == self.values.shape[1]:  # the first sender (the last unit) reads every position: no zeros
                self.grad = self.values.new_empty(self.values.shape)
                self.grad[..., : self.rank].copy_(grad_latent)
                self.grad[..., self.rank :].copy_(grad_rope)
                return
            self.grad = torch.zeros_like(self.values)
        into = self.grad[:, :n]
        into[..., : self.rank].add_(grad_latent)
        into[..., self.rank :].add_(grad_rope)

    def sent(self, offset: int, length: int) -> tuple[Tensor, Tensor] | None:
        """What later units sent positions [offset, offset + length): the latent's (B, length, r) and the RoPE
        key's (B, length, rope) gradient; None where they sent none (the last unit's positions)."""
        if self.grad is None or offset + length > self.grad.shape[1]:
            return None
        grad = self.grad[:, offset : offset + length]
        return grad[..., : self.rank], grad[..., self.rank :]


class LatentSlabs:
    """The latent slabs of a stage's microbatches, by microbatch and layer.

    Args:
        lengths: the units' lengths [L_0, ..., L_{k-1}] of every microbatch, which size the slabs; None: a
            slab grows as units reach past its end.
    """

    def __init__(self, lengths: list[int] | None = None) -> None:
        self.lengths = lengths
        self._slabs: dict[int, dict[int, LatentSlab]] = {}  # microbatch -> layer id -> slab

    def write(
        self, microbatch: int, index: int, offset: int, layer_id: int, latent: Tensor, rope: Tensor
    ) -> LatentSlab:
        """Write unit ``index`` of ``microbatch`` (at ``offset``) of ``layer_id`` (latent (B, L, r), RoPE key
        (B, L, rope)) into its slab, placed by the first unit; the last unit's positions no later unit reads,
        so it writes none. Returns the slab.

        Raises:
            RuntimeError: the units ran forward out of order.
        """
        layers = self._slabs.setdefault(microbatch, {})
        slab = layers.get(layer_id)
        if (slab.filled if slab is not None else 0) != offset or (slab is None) != (index == 0):
            raise RuntimeError(
                f"layer {layer_id}: subsequence {index} of microbatch {microbatch} ran forward after "
                f"{slab.filled if slab is not None else 0} latent positions; forwards must run in subsequence order"
            )
        if slab is None:
            size = sum(self.lengths[:-1]) if self.lengths is not None else 0
            slab = layers[layer_id] = LatentSlab(latent, rope, size)
        if self.lengths is None or index < len(self.lengths) - 1:
            slab.write(offset, latent, rope)
        return slab

    def recorded(self, microbatch: int, offset: int, layer_id: int) -> LatentSlab:
        """The slab ``layer_id`` wrote for ``microbatch`` up to the unit at ``offset`` (a recomputation or
        backward of that unit).

        Raises:
            RuntimeError: the layer did not run that unit forward.
        """
        slab = self._slabs.get(microbatch, {}).get(layer_id)
        if slab is None or slab.filled < offset:
            raise RuntimeError(f"layer {layer_id} recomputed outside the backward of a unit it ran forward")
        return slab

    def release(self, microbatch: int) -> None:
        """Let go of ``microbatch``'s slabs (its last backward on the stage has ended)."""
        self._slabs.pop(microbatch, None)

    def clear(self) -> None:
        """Forget every microbatch (end of step)."""
        self._slabs.clear()

    def tensors(self) -> list[Tensor]:
        """The latents the slabs keep alive (not their gradients)."""
        return [s.values for layers in self._slabs.values() for s in layers.values()]

    def __len__(self) -> int:
        return len(self._slabs)
