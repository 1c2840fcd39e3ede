"""What only CUDA reaches, reached on the CPU: each CUDA-only branch of the package run against a
fake of what needs a GPU.

* Timing events: :class:`FakeCudaEvent` stands in for ``torch.cuda.Event`` on a fake GPU clock
  whose events complete only when synchronised, as a real stream's do.
* The CUDA kernel adapters: each aten op they call is replaced by :class:`FakeAtenOp`, which
  runs the real op's argument parsing and meta kernel on meta copies of the arguments (a
  misplaced or mistyped argument fails there), reads the arguments by their schema names,
  checks what the adapter promises (no varlen offsets, no dropout, grouped K/V heads as they
  are, lengths given), and computes the op's result on the CPU; flash-attn's interface is faked
  alike from the signatures of its 2.6+ source (``window_size_left``, ``softcap``). Each adapter must
  then equal torch's CPU kernel, forward and backward.
* Kernel selection on a fake CUDA device: Hopper, Ampere with and without flash-attn.
* ``cpu_compat`` with CUDA present: nothing patched, FSDP2 left alone.
* The job check on CUDA: a sequence pipeline without FSDP's bf16 parameters is refused.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import _Action
from torch.utils._pytree import tree_map_only

from torchtitan_seq.attention.kernels import (
    CpuSdpaKernel,
    CudaSdpaKernel,
    CudnnSdpaKernel,
    FlashAttnKernel,
    select_kernel,
)
from torchtitan_seq.attention.sdpa_ops import SDPA_OPS, SdpaOps
from torchtitan_seq.instrumentation.render import busy_and_end
from torchtitan_seq.instrumentation.timeline import StepTimeline
from torchtitan_seq.schedules.ordering import B
from torchtitan_seq.schedules.ordering import F as FWD
from torchtitan_seq.titan import cpu_compat

CUDA = torch.device("cuda", 0)  # a device object needs no GPU; nothing is allocated on it

# --------------------------------------------------------------------------
# CUDA timing events


class FakeGpuClock:
    """The fake GPU's clock (ms): ``now`` is set by the test; events recorded up to
    ``completed`` have run (a real stream completes in order, once synchronised)."""

    now = 0.0
    completed = -1.0


class FakeCudaEvent:
    """``torch.cuda.Event(enable_timing=True)``: ``record`` stamps the fake clock,
    ``elapsed_time`` fails on an event that has not completed, as CUDA's does."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "elapsed_time needs enable_timing=True"
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = FakeGpuClock.now

    def synchronize(self) -> None:
        FakeGpuClock.completed = max(FakeGpuClock.completed, self.time)

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        for event in (self, end):
            if event.time is None or event.time > FakeGpuClock.completed:
                raise RuntimeError("CUDA error: device not ready (event not completed)")
        return end.time - self.time


@pytest.fixture
def fake_cuda_events(monkeypatch):
    monkeypatch.setattr(FakeGpuClock, "now", 0.0)
    monkeypatch.setattr(FakeGpuClock, "completed", -1.0)
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", _synchronize_device)


def _synchronize_device(device: Any = None) -> None:
    """``torch.cuda.synchronize``: everything recorded so far has run."""
    FakeGpuClock.completed = FakeGpuClock.now


def _timed(recorder: StepTimeline, start: float, end: float, action: _Action) -> None:
    FakeGpuClock.now = start
    with recorder.action(action.stage_index, action.computation_type, action.microbatch_index):
        FakeGpuClock.now = end


def test_timeline_on_cuda_without_a_started_step_is_empty(fake_cuda_events):
    """The crash of #25: the metrics processor enables the recorder for every job, but only a
    sequence stage starts a step, so under torch's schedules (or pp = 1) no step starts."""
    recorder = StepTimeline()
    recorder.enable(CUDA)
    assert recorder.intervals() == []
    _timed(recorder, 1.0, 2.0, _Action(0, FWD, 0))  # timed, yet no step began
    assert recorder.intervals() == []
    assert busy_and_end(recorder.intervals()) == (0.0, 0.0)  # what the metrics processor gathers


def test_timeline_on_cuda_reads_the_events_once_synchronised(fake_cuda_events):
    recorder = StepTimeline()
    recorder.enable(CUDA)
    FakeGpuClock.now = 100.0
    recorder.start_step()
    _timed(recorder, 102.0, 105.0, _Action(0, FWD, 0))
    _timed(recorder, 106.0, 110.5, _Action(0, B, 0))
    assert FakeGpuClock.completed < 110.5  # queued, not run: intervals() must synchronise
    assert recorder.intervals() == [(2.0, 5.0, _Action(0, FWD, 0)), (6.0, 10.5, _Action(0, B, 0))]
    FakeGpuClock.now = 200.0
    recorder.start_step()  # the next step forgets the last one's actions
    assert recorder.intervals() == []


# --------------------------------------------------------------------------
# The CUDA kernel adapters


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, bias: Tensor | None, window: tuple[int, int]) -> Tensor:
    """Scaled scores (B, Hq, Lq, Lk) of q and the repeated k. ``causal``: the mask aligned at the bottom
    right (query i sees keys up to i + Lk - Lq), as the flash kernels align it (torch's and flash-attn's);
    on a square block top-left is the same. ``bias``: cuDNN's additive one. ``window``: flash-attn's
    (left, right), query i reading keys [i + Lk - Lq - left, i + Lk - Lq + right], -1 unbounded."""
    scores = (q @ k.transpose(-1, -2)) * scale
    lq, lk = scores.shape[-2:]
    if causal:
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), float("-inf"))
    if bias is not None:
        scores = scores + bias
    left, right = window
    distance = torch.arange(lq).unsqueeze(1) + (lk - lq) - torch.arange(lk)  # query i - key j, bottom-right
    if left >= 0:
        scores = scores.masked_fill(distance > left, float("-inf"))
    if right >= 0:
        scores = scores.masked_fill(distance < -right, float("-inf"))
    return scores


def _attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, bias: Tensor | None = None, window=(-1, -1)
) -> tuple[Tensor, Tensor]:
    """Reference attention in torch's layout, q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D), GQA
    by head groups, masked as :func:`_scores` masks: out (B, Hq, Lq, D) and float32 lse (B, Hq, Lq)."""
    n_rep = q.shape[1] // k.shape[1]
    assert n_rep * k.shape[1] == q.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = _scores(q, k, causal, scale, bias, window)
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse.float()


def _attention_grads(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    bias: Tensor | None = None, window: tuple[int, int] = (-1, -1),
):  # fmt: skip
    """dq, dk, dv of a block as FlashAttention's backward computes them, from the ``out`` and ``lse``
    it is given (a merged call's, whose probabilities are the block's share of the unit's): P =
    exp(S - lse), dS = P (dP - rowsum(dout * out)). ``lse`` is read as the CUDA kernels read it, by its
    data pointer as dense (B, H, Lq), whatever its strides."""
    n_rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = _scores(q, kr, causal, scale, bias, window)
    dense = lse.as_strided(lse.shape, torch.empty(lse.shape).stride(), lse.storage_offset())
    p = (scores - dense.unsqueeze(-1)).exp()
    dp = dout @ vr.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq = ds @ kr * scale
    dk, dv = ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout
    b, h, lk, d = k.shape
    return dq, dk.view(b, h, n_rep, lk, d).sum(2), dv.view(b, h, n_rep, lk, d).sum(2)


def _bind(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by their schema names, defaults filled in."""
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{schema.name}: {len(args)} positional arguments"
    bound = dict(zip(positional, args))
    assert not set(kwargs) & set(bound), f"{schema.name}: {set(kwargs) & set(bound)} given twice"
    bound.update(kwargs)
    for a in schema.arguments:
        if a.name not in bound:
            assert a.has_default_value(), f"{schema.name}: {a.name} not given"
            bound[a.name] = a.default_value
    return bound


class FakeAtenOp:
    """A CUDA-only aten op on the CPU: the real op parses the call and its meta kernel shapes the
    result (on meta copies); ``compute`` gets the arguments by name and returns the real values of
    the outputs the adapters read, checked against the meta kernel's shapes and dtypes."""

    def __init__(self, name: str, compute: Callable[[dict[str, Any]], tuple]) -> None:
        self.op = getattr(torch.ops.aten, name)
        self.compute = compute
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        meta_args, meta_kwargs = tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs))
        expected = self.op(*meta_args, **meta_kwargs)
        got = self.compute(_bind(self.op.default._schema, args, kwargs))
        for g, e in zip(got, expected):
            if isinstance(g, Tensor):
                assert (g.shape, g.dtype) == (e.shape, e.dtype), (self.op, g.shape, e.shape)
        self.calls += 1
        return (*got, *expected[len(got) :])


def _no_extras(a: dict[str, Any]) -> None:
    """What every call of the adapters promises: no dropout, no debug mask; a bias (a window's) only
    where the call says it is not causal (the bias holds the causal mask then)."""
    assert a["dropout_p"] == 0.0
    assert not a.get("return_debug_mask", False)
    assert a.get("attn_bias") is None or not a["is_causal"]
    assert a["query"].shape[-1] == a["key"].shape[-1] == a["value"].shape[-1], "one head width: values padded"
    # grouped K/V heads as they are: the ops take them (see kernels.py), so no adapter repeats them
    assert a["key"].shape[1] == a["value"].shape[1] and a["query"].shape[1] % a["key"].shape[1] == 0


def _backward_lengths(a: dict[str, Any]) -> None:
    # Defined offsets select the varlen kernel; max_q and max_k are the padded lengths.
    assert a["cum_seq_q"] is None and a["cum_seq_k"] is None
    assert (a["max_q"], a["max_k"]) == (a["query"].shape[2], a["key"].shape[2])


def _aten_grads(a: dict[str, Any], lse: Tensor) -> tuple[Tensor, ...]:
    """dq, dk, dv of a backward op's call, from its arguments and its (B, H, Lq) log-sum-exp."""
    args = (a["grad_out"], a["query"], a["key"], a["value"], a["out"], lse, a["is_causal"], a["scale"])
    return _attention_grads(*args, a.get("attn_bias"))


def _flash_forward(a):
    _no_extras(a)
    assert a.get("attn_bias") is None  # torch's flash kernel takes no mask
    return _attention(a["query"], a["key"], a["value"], a["is_causal"], a["scale"])


def _flash_backward(a):
    _no_extras(a)
    _backward_lengths(a)
    assert a["logsumexp"].shape == a["query"].shape[:-1]
    return _aten_grads(a, a["logsumexp"])


def _top_left_square(a: dict[str, Any]) -> None:
    """cuDNN's op aligns causal masks top-left: the unit path gives it square causal blocks only."""
    assert not a["is_causal"] or a["query"].shape[2] == a["key"].shape[2], "causal cuDNN call on a non-square block"


def _cudnn_forward(a):
    _no_extras(a)
    _top_left_square(a)
    assert a["compute_log_sumexp"], "the merge needs the log-sum-exp"
    out, lse = _attention(a["query"], a["key"], a["value"], a["is_causal"], a["scale"], a["attn_bias"])
    return out, lse.unsqueeze(-1)  # cuDNN's lse is (B, H, L, 1)


def _cudnn_backward(a):
    _no_extras(a)
    _top_left_square(a)
    _backward_lengths(a)
    assert a["logsumexp"].shape == (*a["query"].shape[:-1], 1)
    assert a["logsumexp"].is_contiguous()
    return _aten_grads(a, a["logsumexp"].squeeze(-1))


@pytest.fixture
def fake_aten(monkeypatch) -> dict[str, FakeAtenOp]:
    ops = {"flash": _flash_forward, "flash_backward": _flash_backward}
    ops |= {"cudnn": _cudnn_forward, "cudnn_backward": _cudnn_backward}
    fakes = {SDPA_OPS[attr]: FakeAtenOp(SDPA_OPS[attr], compute) for attr, compute in ops.items()}
    for attr in ops:
        monkeypatch.setattr(SdpaOps, attr, fakes[SDPA_OPS[attr]])
    return fakes


def _fake_flash_attn() -> types.ModuleType:
    """flash-attn 2's ``flash_attn_interface`` (the signatures of its 2.6+ source),
    layout (B, L, H, D), GQA native; backward writes into the dq, dk, dv it is given."""

    def _flash_attn_forward(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Tensor | None,
        return_softmax: bool,
    ):
        assert dropout_p == 0.0 and softcap == 0.0 and window_size_left >= -1 and window_size_right >= -1
        assert alibi_slopes is None and not return_softmax
        window = (window_size_left, window_size_right)
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        out, lse = _attention(t(q), t(k), t(v), causal, softmax_scale, None, window)
        return out.transpose(1, 2), lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)

    def _flash_attn_backward(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        softmax_lse: Tensor,
        dq: Tensor | None,
        dk: Tensor | None,
        dv: Tensor | None,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Tensor | None,
        deterministic: bool,
        rng_state: Tensor | None = None,
    ):
        assert dropout_p == 0.0 and softcap == 0.0
        assert out.shape == q.shape and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        window = (window_size_left, window_size_right)
        for buffer, grad, like in zip(
            (dq, dk, dv),
            _attention_grads(t(dout), t(q), t(k), t(v), t(out), softmax_lse, causal, softmax_scale, None, window),
            (q, k, v),
        ):
            assert buffer.shape == like.shape
            buffer.copy_(t(grad))
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)  # softmax_d

    module = types.ModuleType("flash_attn.flash_attn_interface")
    module._flash_attn_forward, module._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    return module


@pytest.fixture
def fake_flash_attn(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", _fake_flash_attn())


# (Lq, Lk, causal): a diagonal block, a prefix block (unmasked, Lq != Lk), both odd-sized, and a unit's
# prefix and own keys in one causal call (bottom-right kernels only)
BLOCKS = [(6, 6, True), (5, 7, False), (7, 3, False), (5, 9, True)]
ADAPTER_BLOCKS = [
    (adapter, block)
    for adapter in ("CudaSdpaKernel", "CudnnSdpaKernel", "FlashAttnKernel")
    for block in BLOCKS
    if adapter != "CudnnSdpaKernel" or block != (5, 9, True)  # top-left: square causal blocks only
]


@pytest.mark.parametrize(("adapter", "block"), ADAPTER_BLOCKS)
def test_cuda_adapter_equals_the_cpu_kernel(adapter, block, fake_aten, fake_flash_attn):
    """Forward and backward equal the CPU kernel of the same alignment: torch's (top-left) on square
    causal and unmasked blocks, tests/helpers/bottom_right.py's on a bottom-right adapter's non-square causal one."""
    from bottom_right import BottomRightCpuKernel

    lq, lk, causal = block
    gen = torch.Generator().manual_seed(lq * 10 + lk)
    # (B, L, H, D) transposed, as the model lays q, k, v out; 4 query heads on 2 K/V heads
    q, dout = (torch.randn(2, lq, 4, 8, generator=gen).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(2, lk, 2, 8, generator=gen).transpose(1, 2) for _ in range(2))
    kernel = {"CudaSdpaKernel": CudaSdpaKernel, "CudnnSdpaKernel": CudnnSdpaKernel, "FlashAttnKernel": FlashAttnKernel}[
        adapter
    ]()
    cpu = BottomRightCpuKernel() if causal and lq != lk else CpuSdpaKernel()
    out, lse = kernel.forward(q, k, v, causal, 0.3)
    ref_out, ref_lse = cpu.forward(q, k, v, causal, 0.3)
    assert (out.shape, lse.shape, lse.dtype) == (ref_out.shape, ref_lse.shape, torch.float32)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.3)
    for got, ref in zip(grads, cpu.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref)
    if adapter != "FlashAttnKernel":  # the adapter reached the CUDA ops, not something else
        family = "flash" if adapter == "CudaSdpaKernel" else "cudnn"
        calls = {name: op.calls for name, op in fake_aten.items() if f"_{family}_" in name}
        assert set(calls.values()) == {1}, calls


def _units_over_documents(kernel, q, k, v, dout, reach=None, sinks=None) -> list[Tensor]:
    """Packed documents (ids (1, 48): three of 20, 12 and 16 tokens) cut into units of 24 and 24,
    forward in order and backward last unit first, within ``reach`` and with ``sinks`` where given:
    out, dq, dk, dv (and dsinks). A document's calls read parts of a unit's queries, and so strided
    views of its out and lse."""
    from torchtitan_seq.attention import SequenceAttention
    from torchtitan_seq.runtime.documents import Documents
    from torchtitan_seq.runtime.kv_context import KVContext, Unit
    from torchtitan_seq.runtime.reach import FULL

    ids = torch.tensor([[0] * 20 + [1] * 12 + [2] * 16])
    context = KVContext([24, 24])
    context.documents = [Documents.from_ids(ids)]
    attention = SequenceAttention(layer_id=0, reach=reach or FULL)
    attention.bind(context, kernel)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.detach().requires_grad_()
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    units = [Unit(0, 0, 0, 24, 2), Unit(0, 1, 24, 24, 2)]
    outs = []
    for u in units:
        with context.running(u):
            outs.append(attention(*(t[:, :, u.offset : u.offset + u.length] for t in (q, k, v)), sinks=sinks))
    for u, out in reversed(list(zip(units, outs))):
        with context.backward(u):
            out.backward(dout[:, :, u.offset : u.offset + u.length])
    return [torch.cat(outs, 2).detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("adapter", ["CudaSdpaKernel", "CudnnSdpaKernel", "FlashAttnKernel"])
def test_cuda_adapters_run_units_over_packed_documents_as_the_cpu_kernel(adapter, fake_aten, fake_flash_attn):
    """Through unit attention (documents, a prefix, merged calls) each adapter equals the CPU kernel."""
    gen = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 48, 4, 8, generator=gen).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, 48, 2, 8, generator=gen).transpose(1, 2) for _ in range(2))
    kernel = {"CudaSdpaKernel": CudaSdpaKernel, "CudnnSdpaKernel": CudnnSdpaKernel, "FlashAttnKernel": FlashAttnKernel}
    got = _units_over_documents(kernel[adapter](), q, k, v, dout)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, _units_over_documents(CpuSdpaKernel(), q, k, v, dout)):
        torch.testing.assert_close(g, ref, msg=lambda m, name=name: f"{adapter} {name}: {m}")


@pytest.mark.parametrize("adapter", ["CudaSdpaKernel", "CudnnSdpaKernel", "FlashAttnKernel"])
@pytest.mark.parametrize("window,chunk", [(5, None), (30, None), (None, 10)])
def test_cuda_adapters_run_windows_chunks_sinks_and_narrow_values_as_the_cpu_kernel(
    adapter, window, chunk, fake_aten, fake_flash_attn
):
    """A window (cuDNN's bias; flash-attn's own window; torch's flash kernel hands windowed calls to
    cuDNN), attention chunks, sinks and values narrower than the keys (padded for every CUDA kernel),
    through unit attention over packed documents: each adapter equals the CPU kernel."""
    from torchtitan_seq.runtime.reach import Reach

    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 48, 4, 8, generator=gen).transpose(1, 2)
    k = torch.randn(1, 48, 2, 8, generator=gen).transpose(1, 2)
    v, dout = torch.randn(1, 48, 2, 6, generator=gen).transpose(1, 2), torch.randn(1, 48, 4, 6).transpose(1, 2)
    sinks = torch.randn(4, generator=gen)
    kernel = {"CudaSdpaKernel": CudaSdpaKernel, "CudnnSdpaKernel": CudnnSdpaKernel, "FlashAttnKernel": FlashAttnKernel}
    reach = Reach(window, chunk)
    got = _units_over_documents(kernel[adapter](), q, k, v, dout, reach, sinks)
    ref = _units_over_documents(CpuSdpaKernel(), q, k, v, dout, reach, sinks)
    for name, g, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"{adapter} {name}: {m}")


def test_cuda_adapters_on_meta_tensors_keep_the_real_ops_contract():
    """The real ops' argument parsing and meta kernels alone, with bf16 as on a GPU."""
    q = torch.empty(1, 4, 16, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 2, 48, 64, device="meta", dtype=torch.bfloat16)
    for kernel in (CudaSdpaKernel(), CudnnSdpaKernel()):
        out, lse = kernel.forward(q, k, k, False, 0.125)
        assert (out.shape, lse.shape, lse.dtype) == (q.shape, q.shape[:-1], torch.float32)
        dq, dk, dv = kernel.backward(out, q, k, k, out, lse, False, 0.125)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


# --------------------------------------------------------------------------
# Kernel selection on a CUDA device


@pytest.fixture
def gpu(monkeypatch) -> Callable[..., None]:
    """``gpu(capability, cudnn=True, flash_attn=True)``: what select_kernel sees of the device."""

    def make(capability: tuple[int, int], cudnn: bool = True, flash_attn: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn)
        interface = _fake_flash_attn() if flash_attn else None  # None in sys.modules: ImportError
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)

    return make


@pytest.mark.parametrize(
    "capability, cudnn, flash_attn, backend, expected",
    [
        ((9, 0), True, True, "auto", CudnnSdpaKernel),  # Hopper: cuDNN, flash-attn or not
        ((9, 0), True, False, "auto", CudnnSdpaKernel),
        ((10, 0), True, False, "auto", CudnnSdpaKernel),  # Blackwell counts as "Hopper and newer"
        ((9, 0), True, True, "sdpa", CudnnSdpaKernel),
        ((9, 0), True, True, "flash", FlashAttnKernel),
        ((9, 0), False, False, "auto", CudaSdpaKernel),  # no cuDNN: torch's flash kernel
        ((8, 0), True, True, "auto", FlashAttnKernel),  # Ampere: flash-attn when it imports
        ((8, 0), True, False, "auto", CudaSdpaKernel),
        ((8, 0), True, True, "sdpa", CudaSdpaKernel),
        ((8, 6), True, True, "flash", FlashAttnKernel),
    ],
)
def test_kernel_selection_on_cuda(gpu, capability, cudnn, flash_attn, backend, expected):
    gpu(capability, cudnn, flash_attn)
    assert type(select_kernel(CUDA, backend)) is expected


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_flash_asked_for_but_absent_on_cuda_says_so(gpu, capability):
    gpu(capability, flash_attn=False)
    with pytest.raises(ValueError, match="'flash' but flash-attn is not installed"):
        select_kernel(CUDA, "flash")


# --------------------------------------------------------------------------
# cpu_compat with CUDA present


def test_cpu_compat_does_nothing_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def fail(*args):
        raise AssertionError(f"patched {args[:2]} with CUDA present")

    monkeypatch.setattr(cpu_compat, "_patch", fail)
    cpu_compat.apply()


class _ShardedModule(nn.Module):
    """Stands in for an FSDP2 module (fully_shard needs a process group)."""

    forced: list[bool] = []

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        self.forced.append(enable)


@pytest.mark.parametrize("cuda", [False, True])
def test_fsdp_sum_reduction_only_for_gloo(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(cpu_compat, "FSDPModule", _ShardedModule)
    monkeypatch.setattr(_ShardedModule, "forced", [])
    cpu_compat.fsdp_for_gloo([nn.Sequential(_ShardedModule(), nn.Linear(2, 2))])
    assert _ShardedModule.forced == ([] if cuda else [True])  # NCCL has PREMUL_SUM: FSDP2's own reduction


# --------------------------------------------------------------------------
# The job check on CUDA


@pytest.mark.parametrize(
    "overrides, world, refused",
    [
        ((), 2, True),  # the shipped config, pp = 2 and no FSDP: float32 activations
        (("--parallelism.data_parallel_shard_degree", "2"), 4, False),
        (("--parallelism.data_parallel_shard_degree", "-1"), 4, False),
        (("--parallelism.data_parallel_shard_degree", "2", "--training.mixed_precision_param", "float32"), 4, True),
        (("--parallelism.pipeline_parallel_schedule", "1F1B"), 2, False),  # torch's: SDPA takes float32
        (("--parallelism.pipeline_parallel_degree", "1"), 1, False),  # no pipeline: torchtitan's AMP, SDPA
    ],
)
def test_job_check_on_cuda_refuses_float32_units(monkeypatch, overrides, world, refused):
    from torchtitan.config import ConfigManager

    from torchtitan_seq.titan.v022.job_check import check_job
    from torchtitan_seq.titan.v022.registration import register
    from torchtitan_seq.train import resolve_args

    register()
    job = ConfigManager().parse_args(resolve_args(["--job.config_file", "train_configs/debug_model.toml", *overrides]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if refused:
        with pytest.raises(ValueError, match="on CUDA needs bf16 or fp16 activations"):
            check_job(job, world)
    else:
        check_job(job, world)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_job(job, world)  # the CPU's kernel takes float32
