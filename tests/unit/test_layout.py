"""The package's structure: no import circles, a runtime free of tooling, imports without side
effects, a plain-torch core that runs without torchtitan, short functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torchtitan_seq

PACKAGE = Path(torchtitan_seq.__file__).parent
LAYERS = {
    # a module's folder: its layer; a module imports from its own layer and those below it only
    "runtime": 0,
    "attention": 1,
    "instrumentation": 1,
    "schedules": 2,
    "titan": 3,
    "titan.v022": 4,
    "titan.v03": 4,
    "": 4,  # the package root: the public API and the module paths users type
    "simulate": 5,
    "plan": 5,
    "assets": 0,
}
TOOLS = ("simulate", "plan")
ROOT_MODULES = 6
CORE = ("runtime", "attention", "instrumentation", "schedules", "titan.job_rules", "titan.pipeline_core")
"""What imports without torchtitan: the plain-torch runtime and what both torchtitan versions share
without touching torchtitan."""


def _layer_of(module: str) -> str:
    """The folder of LAYERS that ``module`` (dotted, below torchtitan_seq) lies in."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return ""


def _modules() -> list[str]:
    """Every module of the package, read off the files (importing them is another test's subject)."""
    names = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        names.append(".".join(("torchtitan_seq",) + (parts[:-1] if parts[-1] == "__init__" else parts)))
    return names


def _imports(module: str) -> set[str]:
    """torchtitan_seq modules that ``module`` imports anywhere in its file (functions included)."""
    path = PACKAGE.joinpath(*module.split(".")[1:])
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("torchtitan_seq") and n in ALL}
    return found - {module}


ALL = set(_modules()) | {"torchtitan_seq"}


def _graph() -> dict[str, set[str]]:
    return {m: _imports(m) for m in ALL}


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n) :] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def _reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_imports_point_down_the_layers():
    """runtime <- attention, instrumentation <- schedules <- titan (shared) <- each version's layer and
    the package root; the tools (simulate, plan) import the rest, and nothing imports them."""
    graph, wrong = _graph(), []
    for module, imported in graph.items():
        layer = _layer_of(module)
        for other in imported:
            below = LAYERS[_layer_of(other)] <= LAYERS[layer]
            into_tools = _layer_of(other) in TOOLS and layer not in TOOLS and module != "torchtitan_seq"
            if not below or into_tools:
                wrong.append(f"{module} ({layer or 'root'}) imports {other} ({_layer_of(other) or 'root'})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_package_root_keeps_the_public_api_and_the_paths_users_type():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= ROOT_MODULES and {"__init__.py", "train.py", "config.py", "recipes.py"} <= set(modules)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


# The integration layer of torchtitan 0.3 (this suite's tests run under torchtitan 0.2.2: tests/titan03
# import these under 0.3).
TITAN_03_LAYER = ("torchtitan_seq.titan.v03", "torchtitan_seq.recipes")


def test_importing_any_module_changes_nothing_in_torch_or_torchtitan():
    """Every module but the entry points (torchtitan_seq.train, ``__main__``), which patch
    torch for the CPU and register with torchtitan by design, and torchtitan 0.3's layer."""
    skipped = ("torchtitan_seq.train", *TITAN_03_LAYER)
    code = f"""
import torch, torch.distributed as dist, torch.profiler, importlib
watched = lambda: (torch._utils._get_available_device_type, dist.barrier, torch.profiler.profile.__init__,
                   sorted(vars(torch.cpu)))
before = watched()
for name in {sorted(m for m in ALL if not m.startswith(skipped) and not m.endswith("__main__"))!r}:
    importlib.import_module(name)
assert watched() == before, "an import changed torch"
from torchtitan.protocols import train_spec
from torchtitan.hf_datasets import text_datasets
assert "llama3_seq" not in train_spec._extra_train_specs and "seqpp_text" not in text_datasets.DATASETS
print("ok")
"""
    result = _python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_the_plain_torch_core_runs_without_torchtitan():
    """The README's plain torch.distributed.pipelining example, on one gloo rank, with
    torchtitan made unimportable: a Seq1F1B step equals the whole sequence."""
    code = f"""
import sys
sys.modules["torchtitan"] = None  # any import of torchtitan now fails
import os, torch, torch.distributed as dist
from torch import nn
for name in {sorted(m for m in ALL if m.removeprefix("torchtitan_seq.").startswith(CORE))!r}:
    __import__(name)
from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.runtime.loss import TokenNormalizedLoss
from torchtitan_seq.runtime.partition import partition_sequence
from torchtitan_seq.schedules import ScheduleSeq1F1B
from torchtitan_seq.schedules.stage import SequencePipelineStage

class Tiny(nn.Module):
    # one causal attention layer without RoPE: enough to need the KV context
    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(32, 16), nn.Linear(16, 48), nn.Linear(16, 32)
        self.attention = SequenceAttention(0)
    def forward(self, tokens):
        b, l = tokens.shape
        q, k, v = self.qkv(self.emb(tokens)).view(b, l, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.out(self.attention(q, k, v).transpose(1, 2).reshape(b, l, 16))

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = Tiny()
tokens, labels = torch.randint(0, 32, (4, 24)), torch.randint(0, 32, (4, 24))
ce = lambda out, target: nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum")
ce(model(tokens), labels).div(labels.numel()).backward()
expected = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
stage = SequencePipelineStage(model, 0, 1, torch.device("cpu"), lengths=partition_sequence(24, 3, "even"))
loss_fn = TokenNormalizedLoss(ce)
schedule = ScheduleSeq1F1B(stage, n_microbatches=2, loss_fn=loss_fn)
with loss_fn.normalized_by(labels.numel()):
    schedule.step(tokens, target=labels, losses=[])
for p, g in zip(model.parameters(), expected):
    assert (p.grad - g).abs().max() <= 1e-5 * g.abs().max(), "not exact"
dist.destroy_process_group()
print("ok")
"""
    result = _python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_public_functions_carry_type_hints():
    """Every public function and method of the package (and ``__init__``) annotates its parameters
    and, but for ``__init__``, its return value."""
    unhinted = []

    def visit(node: ast.AST, path: Path, owner: str = "") -> None:
        for n in ast.iter_child_nodes(node):
            if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                visit(n, path, f"{n.name}.")
            elif isinstance(n, ast.FunctionDef) and (not n.name.startswith("_") or n.name == "__init__"):
                a = n.args
                params = [p for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p is not None]
                missing = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
                missing += ["return"] if n.returns is None and n.name != "__init__" else []
                if missing:
                    unhinted.append(f"{path.relative_to(PACKAGE)}:{n.lineno} {owner}{n.name} {missing}")

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text()), path)
    assert not unhinted, "\n".join(unhinted)


def test_no_function_runs_over_80_lines():
    """No function or method of the package runs over 80 lines, decorators aside and its docstring
    included (#28: one concern per function, as torchtitan's are)."""
    long = [
        f"{path.relative_to(PACKAGE)}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80
    ]
    assert not long, "\n".join(long)


def test_the_public_api_imports_from_the_package():
    """What users import from ``torchtitan_seq``, whichever folder holds it now."""
    code = """
import sys, torchtitan_seq
assert not any(m.startswith("torchtitan_seq.") for m in sys.modules), "importing the package imports its modules"
for name in torchtitan_seq.__all__:
    assert getattr(torchtitan_seq, name) is not None, name
print("ok")
"""
    result = _python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_every_module_says_its_concept():
    """A module's docstring is where its one concept is written (docs/architecture.md names the folders)."""
    bare = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not bare, bare


def test_no_private_name_crosses_a_module():
    """A name another module of the package needs is public in its module: no ``from ... import _name``."""
    crossing = [
        f"{path.relative_to(PACKAGE)}:{n.lineno} {n.module}.{a.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torchtitan_seq")
        for a in n.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]
    assert not crossing, "\n".join(crossing)


def test_torchtitans_private_names_only_in_its_registry():
    """torchtitan's private names are reached through torchtitan_seq/titan/titan_internals.py alone, as
    torch's through runtime/torch_internals.py."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "titan_internals.py":
            continue
        tree = ast.parse(path.read_text())
        bound = set()  # names a torchtitan import binds
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torchtitan":
                bound |= {a.asname or a.name for a in n.names}
                found += [f"{path.relative_to(PACKAGE)}:{n.lineno} {a.name}" for a in n.names if a.name.startswith("_")]
            elif isinstance(n, ast.Import):
                bound |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name.split(".")[0] == "torchtitan"}
        for n in ast.walk(tree):
            private = isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
            if private and isinstance(n.value, ast.Name) and n.value.id in bound:
                found.append(f"{path.relative_to(PACKAGE)}:{n.lineno} {n.value.id}.{n.attr}")
    assert not found, "\n".join(found)


MODULE_LINES, CLASS_LINES = 400, 200


def test_no_module_runs_over_400_lines_nor_a_class_over_200():
    """No module of the package runs over 400 lines and no class over 200, decorators aside and its
    docstring included: one concept a module, split where it grows past that."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if (lines := len(text.splitlines())) > MODULE_LINES:
            long.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
        long += [
            f"{path.relative_to(PACKAGE)}:{n.lineno} class {n.name}: {n.end_lineno - n.lineno + 1} lines"
            for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > CLASS_LINES
        ]
    assert not long, "\n".join(long)
