"""The job shape over grids of TP, CP, ``length_multiple``, k and partitions: every unit splits into
2 x CP chunks (a CP rank's share is two of them) each divisible by TP, the lengths sum to the
sequence, and the runtime, the simulator, the memory model and the planner cut alike (or all refuse).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from torchtitan_seq import plan as planner
from torchtitan_seq.runtime.context_parallel import ContextShard
from torchtitan_seq.simulate.build import SimConfig
from torchtitan_seq.simulate.costs import job_shape as simulator_shape
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.memory import MemoryConfig
from torchtitan_seq.simulate.network import Network
from torchtitan_seq.titan.v022.pipeline import job_shape as runtime_shape

FLAVOR = "debugmodel"
SEQ_LENS = (768, 1536, 2048)
GRID = list(
    itertools.product((1, 2, 3, 4), (1, 2, 4), (1, 16, 48, 64), (1, 2, 3, 4, 8), ("even", "compute", "latency"))
)
"""(TP, CP, length_multiple, k, partition)."""


def _job_config(seq_len: int, tp: int, cp: int, multiple: int, k: int, partition: str) -> SimpleNamespace:
    """What :func:`torchtitan_seq.titan.v022.pipeline.job_shape` reads of torchtitan's job config (Seq1F1B, N 4)."""
    parallelism = SimpleNamespace(
        context_parallel_degree=cp,
        tensor_parallel_degree=tp,
        pipeline_parallel_microbatch_size=1,
        pipeline_parallel_schedule="Seq1F1B",
        pipeline_parallel_layers_per_stage=None,
    )
    sequence = SimpleNamespace(
        num_subsequences=k, partition=partition, expected_document_length=0, length_multiple=multiple
    )
    return SimpleNamespace(
        sequence_pipeline=sequence,
        parallelism=parallelism,
        training=SimpleNamespace(seq_len=seq_len, local_batch_size=4),
    )


def _cuts(seq_len: int, tp: int, cp: int, multiple: int, k: int, partition: str) -> dict[str, object]:
    """Each tool's lengths, or the ValueError it refuses with."""
    args = flavor_shape(FLAVOR)
    runtime = runtime_shape(_job_config(seq_len, tp, cp, multiple, k, partition), args, tp, 2)
    network = Network(gpus_per_node=tp * cp, gpus_per_rank=tp * cp, tensor_parallel=tp, context_parallel=cp)
    sim = SimConfig("Seq1F1B", 2, 4, k, cost="transformer", seq_len=seq_len, partition=partition)
    sim = SimConfig(**{**sim.__dict__, "length_multiple": multiple, "network": network})
    job = planner.Job(FLAVOR, seq_len, 4, length_multiple=multiple)
    makers = {
        "runtime": lambda: runtime.lengths,
        "simulator": lambda: simulator_shape(sim).lengths,
        "memory model": lambda: MemoryConfig(FLAVOR, runtime, "Seq1F1B", 2).shape.lengths,
        "planner": lambda: job.shape(planner.ScheduleChoice("Seq1F1B", k, partition), tp, cp).lengths,
    }
    out: dict[str, object] = {}
    for name, make in makers.items():
        try:
            out[name] = list(make())
        except ValueError as e:
            out[name] = e
    return out


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_every_tool_cuts_alike_into_chunks_tp_and_cp_can_share(seq_len):
    cut = 0
    for tp, cp, multiple, k, partition in GRID:
        cuts = _cuts(seq_len, tp, cp, multiple, k, partition)
        where = (seq_len, tp, cp, multiple, k, partition, cuts)
        refused = [name for name, c in cuts.items() if isinstance(c, ValueError)]
        if refused:
            assert len(refused) == len(cuts), where  # one refuses, all do
            continue
        lengths = cuts["runtime"]
        assert all(c == lengths for c in cuts.values()), where
        assert len(lengths) == k and sum(lengths) == seq_len and min(lengths) > 0, where
        offset = 0
        for length in lengths:
            assert length % multiple == 0, where
            for rank in range(cp):  # the runtime's own CP split of the unit
                segments = ContextShard(None, rank, cp).segments(offset, length)
                assert all((b - a) % tp == 0 and b > a for a, b in segments), (where, rank, segments)
            offset += length
        cut += 1
    assert cut > len(GRID) // 4  # the grid is mostly cuts, not refusals
