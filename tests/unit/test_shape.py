"""The job shape: one cut of the sequence for the runtime and its tools, without torch."""

import subprocess
import sys

import pytest

from torchtitan_seq.runtime.partition import partition_sequence
from torchtitan_seq.runtime.shape import LENGTH_MULTIPLE, JobShape
from torchtitan_seq.simulate.build import SimConfig
from torchtitan_seq.simulate.costs import job_shape
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.memory import MemoryConfig
from torchtitan_seq.simulate.network import Network

DEBUG = flavor_shape("debugmodel")


def test_lengths_are_cut_on_the_lcm_of_the_length_multiple_and_tp():
    shape = JobShape.of_model(DEBUG, 3072, 4, "compute", length_multiple=64, tp=3)
    assert shape.multiple == 192
    assert shape.lengths == partition_sequence(3072, 4, "compute", multiple=192, cost=shape.cost)
    assert all(n % 192 == 0 for n in shape.lengths) and sum(shape.lengths) == 3072
    with pytest.raises(ValueError, match="not a multiple of 192"):
        _ = JobShape.of_model(DEBUG, 2048, 4, "compute", length_multiple=64, tp=3).lengths
    assert JobShape(2048, 1, whole=True, tp=3).lengths == [2048]  # torch's schedules: uncut


def test_the_simulator_and_the_memory_model_cut_as_the_runtime():
    """One default multiple; the simulator takes TP from its network."""
    assert (
        SimConfig("Seq1F1B", 2, 4).length_multiple
        == MemoryConfig("debugmodel", JobShape(2048)).shape.length_multiple
        == 1
    )
    assert LENGTH_MULTIPLE == 1
    runtime = JobShape.of_model(DEBUG, 2048, 4, "compute", length_multiple=16, tp=2)
    sim = SimConfig(
        "Seq1F1B",
        2,
        4,
        4,
        cost="transformer",
        seq_len=2048,
        partition="compute",
        length_multiple=16,
        network=Network(gpus_per_rank=2, tensor_parallel=2),
    )
    memory = MemoryConfig("debugmodel", runtime, "Seq1F1B", 2)
    assert job_shape(sim).lengths == memory.shape.lengths == runtime.lengths


def test_it_imports_neither_torch_nor_torchtitan():
    code = "import sys, torchtitan_seq.runtime.shape; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    expected = ["torchtitan_seq"] + [f"torchtitan_seq.runtime{m}" for m in ("", ".partition", ".shape")]
    assert out.strip() == str(expected)


@pytest.mark.parametrize("multiple", [0, -4])
def test_a_length_multiple_below_one_is_refused_by_name(multiple):
    with pytest.raises(ValueError, match=r"sequence_pipeline.length_multiple = -?\d+: it must be at least 1"):
        JobShape(256, 4, "even", length_multiple=multiple)
