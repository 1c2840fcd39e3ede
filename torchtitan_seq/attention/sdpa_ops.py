"""The aten kernels behind SDPA that return the log-sum-exp, and their backwards, bound once for the block
kernels' calls (:mod:`torchtitan_seq.attention.kernels`).

Called through its op packet (``torch.ops.aten.<op>(...)``) an op has its overload resolved in Python at
each call, four calls per unit and layer: here the forwards are bound as torch's C functions and the
backwards as their ``default`` overloads, once. The ops are torch's private
names, reached through :mod:`torchtitan_seq.runtime.torch_internals`.
"""

from __future__ import annotations

from torchtitan_seq.runtime.torch_internals import (
    cpu_flash_attention,
    cpu_flash_attention_backward,
    cudnn_attention,
    cudnn_attention_backward,
    flash_attention,
    flash_attention_backward,
)

__all__ = ["SDPA_OPS", "SdpaOps"]


class _SdpaOps:
    """The aten kernels behind SDPA that return the log-sum-exp, and their backwards, as attributes
    (``SdpaOps.cpu_flash(q, k, v, ...)``), bound once: the forwards as torch's C functions, the backwards
    as their ``default`` overloads. A test stands a fake in for a CUDA-only op by setting the instance's
    attribute (:data:`SDPA_OPS` names each attribute's aten op)."""

    cpu_flash = cpu_flash_attention  # builtins: not bound as methods
    cpu_flash_backward = cpu_flash_attention_backward.default
    flash = flash_attention
    flash_backward = flash_attention_backward.default
    cudnn = cudnn_attention
    cudnn_backward = cudnn_attention_backward.default


SDPA_OPS: dict[str, str] = {
    "cpu_flash": "_scaled_dot_product_flash_attention_for_cpu",
    "cpu_flash_backward": "_scaled_dot_product_flash_attention_for_cpu_backward",
    "flash": "_scaled_dot_product_flash_attention",
    "flash_backward": "_scaled_dot_product_flash_attention_backward",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "cudnn_backward": "_scaled_dot_product_cudnn_attention_backward",
}
"""Each attribute of :data:`SdpaOps` -> its aten op's name."""


SdpaOps = _SdpaOps()
