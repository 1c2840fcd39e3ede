"""The times the planner prices besides the simulated passes' FLOPs: where unit times come from
(calibration files, else the transformer cost model plus a fixed cost per unit), TP's collectives,
and the network a rank's transfers cross."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from torchtitan_seq.plan.choices import ScheduleChoice
from torchtitan_seq.plan.flops import step_flops, unit_flops
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.runtime.partition import UnitCost
from torchtitan_seq.simulate.costs import fit_cost_files
from torchtitan_seq.simulate.network import Network
from torchtitan_seq.titan.flavors import ModelShape


@dataclass(frozen=True)
class Costs:
    """Where unit times come from: a calibration file measured at the same pp, chunks per
    rank, chunk count and cut, else the transformer model at ``flops_per_gpu`` plus
    ``unit_overhead_s`` per unit and layer, which the files (when given) fit: the fixed cost
    of :func:`~torchtitan_seq.simulate.costs.fit_cost_files` (none when their units cannot
    separate it) and the geometric mean of the cost-model FLOP/s the rest achieved."""

    files: tuple[tuple[tuple[int, int, int, tuple[int, ...]], str], ...]
    flops_per_gpu: float
    unit_overhead_s: float = 0.0

    @classmethod
    def load(cls, job: Job, cluster: Cluster, args: ModelShape) -> Costs:
        if not job.costs:
            return cls((), cluster.flops_per_gpu, cluster.unit_overhead_s)
        files, rates, loaded = {}, [], []
        for path in job.costs:
            data = json.loads(path.read_text()) if path.is_file() else {}
            if data.get("unit") != "s" or "lengths" not in data or "stages" not in data:
                raise ValueError(f"--cost {path}: not a calibration file (benchmarks/bench.py --calibrate writes them)")
            if data.get("flavor") != job.flavor or data.get("seq_len") != job.seq_len:
                raise ValueError(
                    f"--cost {path}: measured for flavor {data.get('flavor')!r} at seq_len {data.get('seq_len')}, "
                    f"not {job.flavor!r} at {job.seq_len}"
                )
            pp, lengths = len(data["stages"]), tuple(data["lengths"])
            chunks = data.get("chunks", [[r] for r in range(pp)])
            files[pp, len(chunks[0]), 1 + max(map(max, chunks)), lengths] = str(path)
            loaded.append((path, pp, data))
        # Their fixed cost per unit, per layer: a fit needs one stage size (else none is taken).
        pps = {pp for _, pp, _ in loaded}
        fixed_per_layer = 0.0
        if len(pps) == 1:
            try:
                fixed_per_layer = fit_cost_files([path for path, _, _ in loaded]).fixed * pps.pop() / args.n_layers
            except ValueError:
                pass  # units of one length only: the FLOP rate below absorbs the fixed cost
        for _, pp, data in loaded:
            lengths = list(data["lengths"])
            measured = sum(data["F"]) + sum(data["B"]) - len(lengths) * fixed_per_layer * args.n_layers / pp
            rates.append(
                step_flops(unit_flops(UnitCost.from_model_args(args), lengths, 0.0), args.n_layers, pp) / measured
            )
        return cls(tuple(files.items()), math.exp(sum(map(math.log, rates)) / len(rates)), fixed_per_layer)

    def cost_for(self, choice: ScheduleChoice, pp: int, lengths: list[int]) -> str:
        """SimConfig.cost for ``choice`` on ``pp`` ranks cutting sequences into ``lengths``."""
        chunks = pp * choice.stages_per_rank // choice.parameter_copies
        return dict(self.files).get((pp, choice.stages_per_rank, chunks, tuple(lengths)), "transformer")


def tp_seconds(args: ModelShape, seq_len: float, pp: int, tp: int, recompute: float, cluster: Cluster) -> float:
    """Tensor parallelism's collectives for one microbatch on one rank, which torchtitan does
    not overlap with compute: per layer, sequence parallelism's two all-gathers and two
    reduce-scatters of the activations (bf16) in forward, as many in backward and in each
    recomputed forward, each moving (tp - 1) / tp of S x dim (under CP the rank's S / c) over a
    ring in the node."""
    if tp == 1:
        return 0.0
    per_collective = cluster.intra_node.seconds((tp - 1) / tp * seq_len * args.dim * 2)
    return args.n_layers / pp * 4 * (2 + recompute) * per_collective


def step_network(cluster: Cluster, costs: Costs, tp: int, cp: int, dp: int) -> Network:
    """The links of a (tp, cp, dp) rank of ``cluster``, at the costs' FLOP/s."""
    return Network(
        cluster.intra_node,
        cluster.inter_node,
        cluster.gpus_per_node,
        gpus_per_rank=tp * cp * dp,
        tensor_parallel=tp,
        context_parallel=cp,
        flops_per_gpu=costs.flops_per_gpu,
    )
