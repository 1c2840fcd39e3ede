"""Instrumentation off the hot path, in one process: which steps the trainer meters and times,
that no saved-tensor hook runs on the others, and what their metrics records then hold."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.train import Trainer

from torchtitan_seq.instrumentation import timeline
from torchtitan_seq.instrumentation.memory import ActivationMemory
from torchtitan_seq.schedules.ordering import F
from torchtitan_seq.titan import metrics
from torchtitan_seq.titan.metrics import MetricsRecord
from torchtitan_seq.titan.v022.metrics import SeqMetricsProcessor
from torchtitan_seq.titan.v022.trainer import SeqTrainer


def _processor(freq: int, log_freq: int = 1, meter: ActivationMemory | None = None) -> SeqMetricsProcessor:
    """A processor without torchtitan's set-up: only what ``log`` and the due-step logic read."""
    processor = object.__new__(SeqMetricsProcessor)
    processor.job_config = SimpleNamespace(
        sequence_pipeline=SimpleNamespace(activation_memory_freq=freq, num_subsequences=4, pipeline_timeline=True),
        metrics=SimpleNamespace(log_freq=log_freq),
        profiling=SimpleNamespace(enable_profiling=False, profile_freq=10),
        parallelism=SimpleNamespace(pipeline_parallel_schedule="Seq1F1B"),
        job=SimpleNamespace(dump_folder="."),
    )
    processor.device_memory_monitor = SimpleNamespace(device=torch.device("cpu"))
    processor.activation_memory = meter if meter is not None else ActivationMemory()
    return processor


def test_activations_are_metered_on_the_first_and_every_nth_logged_step():
    def metered(freq: int, log_freq: int) -> list[int]:
        processor = _processor(freq, log_freq)
        return [s for s in range(1, 61) if processor.should_log(s) and processor.meters_activations(s)]

    assert metered(1, 1) == list(range(1, 61))
    assert metered(10, 1) == [1, 10, 20, 30, 40, 50, 60]
    assert metered(2, 10) == [1, 20, 40, 60]  # every 2nd logged step: 10, 20, ... are logged
    assert metered(0, 1) == []
    unattached = _processor(1)
    unattached.activation_memory = None
    assert not unattached.meters_activations(1)


def _trainer(freq: int, step: int, timeline_on: bool = True) -> SeqTrainer:
    trainer = object.__new__(SeqTrainer)
    trainer.activation_memory = ActivationMemory()
    trainer.metrics_processor = _processor(freq, meter=trainer.activation_memory)
    trainer.metrics_processor.job_config.sequence_pipeline.pipeline_timeline = timeline_on
    trainer.job_config = trainer.metrics_processor.job_config
    trainer.device = torch.device("cpu")
    trainer.step = step
    trainer.parallel_dims = SimpleNamespace(pp_enabled=False)
    return trainer


@pytest.mark.parametrize(
    "freq,step,timeline_on,metered,timed",
    [
        (10, 1, True, True, True),
        (10, 2, True, False, True),
        (10, 10, True, True, True),
        (0, 1, True, False, True),
        (1, 3, False, True, False),
    ],
)
def test_the_trainer_arms_meter_and_timeline_for_the_step_only(freq, step, timeline_on, metered, timed, monkeypatch):
    """train_step arms the recorder and the meter for the steps that report them; forward and
    backward run under the meter's saved-tensor hook on those steps and under none on the others."""
    seen = {}

    def parent_forward_backward(self, **kwargs):
        seen["hooks"] = torch._C._autograd._top_saved_tensors_default_hooks(False)
        x = torch.randn(4, 8, requires_grad=True)
        (x.exp() * x).sum().backward()
        return torch.zeros(())

    def parent_train_step(self, data_iterator):
        seen["recording"] = timeline.RECORDER.enabled
        self.forward_backward_step(input_dict={}, labels=torch.zeros(()), global_valid_tokens=torch.ones(()))

    monkeypatch.setattr(Trainer, "forward_backward_step", parent_forward_backward)
    monkeypatch.setattr(Trainer, "train_step", parent_train_step)
    trainer = _trainer(freq, step, timeline_on)
    trainer.train_step(iter(()))
    assert seen["recording"] is timed
    assert (seen["hooks"] is not None) is metered
    assert (trainer.activation_memory.peak > 0) is metered
    assert not timeline.RECORDER.enabled and not trainer.metering  # disarmed after the step


def _logged(processor: SeqMetricsProcessor, step: int, monkeypatch, tmp_path) -> tuple[dict, dict]:
    """The metrics ``processor.log`` hands torchtitan, and the record they make."""
    handed = {}
    monkeypatch.setattr(
        MetricsProcessor, "log", lambda self, step, *a, extra_metrics=None: handed.update(extra_metrics)
    )
    processor.log(step, 1.0, 1.0, 1.0)
    record = MetricsRecord(tmp_path / "metrics.jsonl")
    record.log(handed, step)
    return handed, json.loads(record.path.read_text().splitlines()[-1])


def test_unmetered_steps_carry_no_activation_figure(monkeypatch, tmp_path):
    meter = ActivationMemory()
    with meter.track():
        x = torch.randn(16, 16, requires_grad=True)
        y = x.exp()
    processor = _processor(10, meter=meter)
    handed, record = _logged(processor, 1, monkeypatch, tmp_path)
    assert handed["memory/peak_activation_bytes/rank0"] == meter.peak > 0
    assert record["peak_activation_bytes"] == [meter.peak]
    assert record["peak_allocated_bytes"] is None  # CPU: no allocator peak
    handed, record = _logged(processor, 2, monkeypatch, tmp_path)  # not due: the step-1 peak is not repeated
    assert not any(name.startswith("memory/peak_") for name in handed), handed
    assert record["peak_activation_bytes"] is None and record["bubble_ratio"] == []
    del y


def test_cuda_reports_the_allocator_peak_beside_the_metered_figure(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 7 * 2**20)
    assert metrics._allocator_peak(torch.device("cuda", 0)) == 7 * 2**20
    assert metrics._allocator_peak(torch.device("cpu")) == -1
    monkeypatch.setattr(metrics, "_allocator_peak", lambda device: 7 * 2**20)  # as on CUDA
    handed, record = _logged(_processor(1), 1, monkeypatch, tmp_path)
    assert handed["memory/peak_allocated_bytes/rank0"] == 7 * 2**20
    assert record["peak_allocated_bytes"] == [7 * 2**20]


def test_a_step_the_recorder_skips_reads_as_no_step():
    rec = timeline.StepTimeline()
    rec.enable("cpu")
    rec.start_step()
    with rec.action(0, F, 0):
        pass
    assert len(rec.intervals()) == 1
    rec.disable()
    rec.start_step()  # the next step, not recorded: no clock read, and not the previous step's actions
    with rec.action(0, F, 1):
        pass
    assert rec.intervals() == []
