"""``Function.apply`` as torch 2.15 runs it, in C, on the torch releases before it: the bypass of the
Python ``apply`` that unit attention's autograd function (:class:`~torchtitan_seq.attention.UnitAttention`)
takes once per unit and layer. torch's C apply and functorch's hooks are private names, reached through
:mod:`torchtitan_seq.runtime.torch_internals`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchtitan_seq.runtime.torch_internals import C_FUNCTION_APPLY, functorch_transforms_active, unwrap_if_dead

__all__ = ["function_apply"]


def function_apply(fn: type[torch.autograd.Function], tensors: int) -> Callable[..., Any]:
    """``fn.apply`` (``fn`` defines no ``setup_context``; its first ``tensors`` arguments are tensors) as
    torch 2.15 runs it, in C. Under older torch ``Function.apply`` is Python: it binds every call's
    arguments for a ``setup_context`` and unwraps functorch's dead wrappers in a generator, once per unit
    and layer here; without a functorch transform active that is the C apply of the arguments unwrapped,
    and under one it is torch's own."""
    in_c = torch.autograd.Function.__dict__["apply"] is C_FUNCTION_APPLY
    if in_c or fn.setup_context is not torch.autograd.Function.setup_context:
        return fn.apply
    run = C_FUNCTION_APPLY.__get__(None, fn)
    unwrap, transforms_active = unwrap_if_dead, functorch_transforms_active

    def apply(*args: Any) -> Any:
        if transforms_active():
            return fn.apply(*args)
        return run(*map(unwrap, args[:tensors]), *args[tensors:])

    return apply
