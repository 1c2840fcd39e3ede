"""torch's private names are reached through torchtitan_seq/runtime/torch_internals.py alone, each listed there
with the reason the public API does not serve; and the features it bridges are what the installed
torch has."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest
import torch
import torch.distributed.pipelining as pipelining

import torchtitan_seq
from torchtitan_seq.attention.function_apply import function_apply
from torchtitan_seq.runtime import torch_internals

PACKAGE = pathlib.Path(torchtitan_seq.__file__).parent
INTERNALS = pathlib.Path(torch_internals.__file__)


def _torch_private_attributes() -> frozenset[str]:
    """The private attributes and methods torch's pipelining and ``nn.Module`` define (``self._x``,
    ``def _x``) in the installed torch: reaching one on a torch object, or overriding one, is a private use."""
    names: set[str] = set()
    for f in [*pathlib.Path(pipelining.__file__).parent.glob("*.py"), pathlib.Path(torch.nn.modules.module.__file__)]:
        text = f.read_text()
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)", text)) | set(re.findall(r"def (_[A-Za-z]\w*)", text))
    # torch 2.11's stage hooks, overridden for it where it still runs (benchmarks/gpu_check.sh)
    return frozenset(names | {"_validate_fwd_input", "_validate_fwd_outputs", "_get_init_p2p_neighbors_ops"})


TORCH_PRIVATE = _torch_private_attributes()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _chain(node: ast.AST) -> list[str]:
    """``a.b.c`` -> ["a", "b", "c"]; [] where the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def private_torch_uses(path: pathlib.Path) -> dict[str, int]:
    """The private torch names a module uses -> the first line using each. Module-level names are
    qualified (``torch.utils._pytree``, ``torch.distributed.pipelining.schedules._Action``,
    ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``): private modules imported,
    private names imported from torch, private components of attribute chains that start at torch
    or at a name bound to something of torch's. Attributes and methods are bare (``_stages``): torch
    pipelining's private attributes reached or overridden."""
    tree = ast.parse(path.read_text())
    bound = {"torch": "torch"}  # local name -> the torch module or object it stands for
    uses: dict[str, int] = {}

    def use(name: str, line: int) -> None:
        uses.setdefault(name, line)

    def qualified(dotted: str, line: int) -> None:
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            if _private(part):
                use(".".join(parts[: i + 1]), line)
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    qualified(alias.name, node.lineno)
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                qualified(f"{node.module}.{alias.name}", node.lineno)
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in bound and any(map(_private, chain[1:])):
                qualified(".".join([bound[chain[0]], *chain[1:]]), node.lineno)
            elif node.attr in TORCH_PRIVATE:
                use(node.attr, node.lineno)
        elif isinstance(node, ast.FunctionDef) and node.name in TORCH_PRIVATE:
            use(node.name, node.lineno)
    return uses


def _own_private_names() -> set[str]:
    """Private names the package defines for itself outside torch_internals (its own classes'
    methods and attributes), which torch's pipelining happens to use too: not torch's."""
    own = set()
    for f in PACKAGE.rglob("*.py"):
        if f == INTERNALS:
            continue
        text = f.read_text()
        own |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=[^=]", text))
    return own


def test_private_torch_names_are_used_only_in_torch_internals():
    own = _own_private_names()
    elsewhere = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        if f == INTERNALS:
            continue
        # a name the module's own classes define is theirs, unless it is also one torch defines and
        # the module subclasses a torch class (then it is an override of torch's)
        found = {name: line for name, line in private_torch_uses(f).items() if name not in own}
        if found:
            elsewhere[str(f.relative_to(PACKAGE))] = found
    assert not elsewhere, f"torch's private names outside torch_internals.py (reach them through it): {elsewhere}"


def test_every_private_name_in_torch_internals_is_listed_with_its_reason():
    used = set(private_torch_uses(INTERNALS))
    listed = set(torch_internals.PRIVATE_NAMES)
    assert used - listed == set(), f"used but not listed in PRIVATE_NAMES: {sorted(used - listed)}"
    assert listed - used == set(), f"listed in PRIVATE_NAMES but not used: {sorted(listed - used)}"
    assert all(len(why) > 20 for why in torch_internals.PRIVATE_NAMES.values())


def test_the_scan_sees_each_kind_of_private_use(tmp_path):
    """The scanner itself bites: each way a module can reach a private torch name is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch._dynamo.config\n"
        "from torch.utils._pytree import tree_map_only\n"
        "from torch.distributed.pipelining.schedules import _Action\n"
        "x = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu\n"
        "class S:\n"
        "    def _prepare_forward_infra(self):\n"
        "        return self._n_microbatches\n"
        "from torch.distributed.pipelining import schedules as s\n"
        "y = s._add_send_recv\n"
    )
    assert set(private_torch_uses(sample)) == {
        "torch._dynamo",
        "torch.utils._pytree",
        "torch.distributed.pipelining.schedules._Action",
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "torch.distributed.pipelining.schedules._add_send_recv",
        "_prepare_forward_infra",
        "_n_microbatches",
    }


def test_feature_flags_match_the_installed_torch():
    from torch.distributed.pipelining import schedules

    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    step = inspect.signature(schedules.PipelineScheduleMulti.step).parameters
    assert torch_internals.PRE_SPLIT_STEP == ("arg_mbs" in step) == (version >= (2, 14))
    assert torch_internals.WAIT_SEND == hasattr(schedules, "_add_wait_send")
    assert torch_internals.FINALIZE_GRADIENTS == ("finalize_gradients" in step)


@pytest.mark.parametrize("name", sorted(torch_internals.__all__))
def test_every_exported_name_exists(name):
    assert getattr(torch_internals, name) is not None


class _Scale(torch.autograd.Function):
    """x * factor, with ctx as forward's first argument (no setup_context), as UnitAttention."""

    @staticmethod
    def forward(ctx, x, y, factor):
        ctx.factor = factor
        return x * factor + y

    @staticmethod
    def backward(ctx, dout):
        return dout * ctx.factor, dout, None


def test_function_apply_is_torchs_apply():
    """The same output and gradients as Function.apply (torch's own object from torch 2.15, which runs it in
    C); under a functorch transform torch's own path, which refuses a Function without setup_context."""
    apply = function_apply(_Scale, tensors=2)
    in_python = isinstance(torch.autograd.Function.__dict__["apply"], classmethod)  # before torch 2.15
    assert (apply == _Scale.apply) != in_python
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = apply(x, y, 2.0)
    assert type(out.grad_fn).__name__ == "_ScaleBackward"
    out.sum().backward()
    assert torch.equal(out, x * 2.0 + y)
    assert torch.equal(x.grad, torch.full((3,), 2.0)) and torch.equal(y.grad, torch.ones(3))
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: apply(t, t, 2.0).sum())(torch.randn(3))


@pytest.mark.slow  # a compile (aot_eager: seconds)
def test_a_compiled_graph_keeps_the_gradient_of_an_async_collective_input():
    """An AsyncCollectiveTensor that requires grad (a reduce-scatter not yet waited for, as TP's embedding
    hands the first block) gets its gradient from a compiled graph, as in eager; torch 2.13 to 2.15 drop it
    without keep_async_collective_input_grads."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    assert torch_internals.ASYNC_COLLECTIVE_REPAIRABLE and torch_internals.keep_async_collective_input_grads()
    scale = torch.randn(4, requires_grad=True)
    grads = []

    def block(t: torch.Tensor) -> torch.Tensor:
        return (t * scale).sin()

    for compiled in (False, True):
        x = AsyncCollectiveTensor(torch.arange(12.0).view(3, 4)).requires_grad_()
        (torch.compile(block, backend="aot_eager", fullgraph=True) if compiled else block)(x).sum().backward()
        grads.append(x.grad)
    assert grads[1] is not None and torch.allclose(grads[0], grads[1])
