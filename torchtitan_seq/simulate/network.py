"""Communication in the simulator: links between pipeline ranks, what crosses them, and
how long it takes in the simulator's unit of time.

A :class:`Network` describes the cluster under one pipeline: an intra-node and
an inter-node :class:`Link` (bandwidth and latency, per GPU and direction),
GPUs per node, the GPUs behind each pipeline rank, and the achieved compute
rate that converts seconds into the cost model's unit. :class:`Transfers`
applies it to one simulated step:

- a SEND of unit j carries its activations (or their gradient, the same
  size): ``microbatch_size x L_j x dim x activation_bytes / tensor_parallel``
  bytes (a TP rank sends its own shard; with sequence parallelism the stage's
  output is sharded over the sequence). The data is usable on the receiving
  rank ``latency + bytes / bandwidth`` after the SEND, over the link between
  the two ranks; transfers do not contend (each GPU has its own NIC and
  NVLink lanes; links are full duplex).
- under context parallelism (``context_parallel`` c, :mod:`torchtitan_seq.runtime.context_parallel`) a rank
  computes 1/c of every unit and sends its share; in each layer it all-gathers the unit's K/V over
  its CP group and reduce-scatters their gradient in backward (:meth:`Network.kv_collective_seconds`:
  a ring of c - 1 steps, each one rank's share of K/V over the CP link). CP ranks are ``tensor_parallel``
  apart in the mesh, inside a pipeline rank's GPUs: on one node unless c x tp GPUs span several.
- the schedules that hold two copies of each model chunk (BSIPipe, Chimera)
  end the step as :class:`~torchtitan_seq.schedules.MirroredCopies` does: each
  pair of ranks that share chunks all-reduces the gradients of those chunks
  (one flat buffer), and after the optimizer step their parameters (a second
  all-reduce of the same size). A 2-rank ring all-reduce of X bytes is 2 steps
  of X / 2 over the pair's link. This is what the ``paired`` placement makes
  cheaper: mirrored ranks on neighbouring GPUs, inside a node.

Where a pipeline rank sits: torchtitan's device mesh is ordered
(pp, dp_replicate, dp_shard, cp, tp), pp outermost, so pipeline rank r's GPUs
are the global ranks ``r g .. r g + g - 1`` with g = ``gpus_per_rank`` (the
product of the other degrees), and global rank i is on node
``i // gpus_per_node``. Tensor parallelism stays inside a node; pipeline ranks
fill nodes in order (``gpus_per_node / g`` of them per node) and spread over
consecutive nodes when p g exceeds a node.

Time: the simulator's unit is one forward of a whole microbatch on 1/p of the
layers. With ``flops_per_gpu`` F (achieved, per GPU), that is
``microbatch_size x n_layers x UnitCost.forward(S, 0) / (p x tensor_parallel x F)``
seconds for the 'uniform' and 'transformer' costs; a measured cost file in
seconds (``"unit": "s"``, as ``bench.py --calibrate`` writes) needs no
conversion. Free links (the default) leave the timings exactly as without a
network, and need no model.

Not modelled: contention between transfers, data-parallel and FSDP
collectives (the same for every schedule on one copy), the optimizer's time,
overlap of the copies' all-reduce with compute (MirroredCopies runs it after
the step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchtitan_seq.runtime.model_counts import chunk_moe_layers, kv_values, layer_weights
from torchtitan_seq.runtime.partition import UnitCost

if TYPE_CHECKING:
    from torchtitan.models.llama3 import TransformerModelArgs

__all__ = ["Link", "Network", "Transfers", "chunk_parameters", "parameter_count"]


def chunk_parameters(
    args: TransformerModelArgs, layers: float, first: bool, last: bool, tp: int = 1, active: bool = False
) -> float:
    """Parameters of a model chunk of ``layers`` blocks on one TP rank: the matrices (every expert's) and
    embeddings divided by ``tp``, norm weights, routers, biases and sinks whole
    (:func:`~torchtitan_seq.runtime.model_counts.layer_weights`); ``first`` adds the token embeddings,
    ``last`` the final norm and the output projection. In a family with MoE layers the first chunk holds
    the leading dense ones (:func:`~torchtitan_seq.runtime.model_counts.chunk_moe_layers`). ``active``:
    the experts a token runs through only."""
    d = args.dim

    def per_layer(moe_layer: bool) -> float:
        split, whole = layer_weights(args, moe_layer, active)
        return split / tp + whole

    body = layers * per_layer(False)
    if moe_layers := chunk_moe_layers(args, layers, first):
        body = (layers - moe_layers) * per_layer(False) + moe_layers * per_layer(True)
    embeddings = args.vocab_size * d / tp
    return body + (embeddings if first else 0) + ((embeddings + d) if last else 0)


@dataclass(frozen=True)
class Link:
    """One direction of the connection between two GPUs."""

    bandwidth: float = math.inf
    """Bytes per second; inf: free."""
    latency: float = 0.0
    """Seconds from a transfer's start to its first byte arriving."""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(
                f"a link needs a bandwidth > 0 and a latency >= 0, got {self.bandwidth} B/s, {self.latency} s"
            )

    @property
    def free(self) -> bool:
        """True when a transfer over this link takes no time."""
        return self.bandwidth == math.inf and self.latency == 0.0

    def seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over this link."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Network:
    """The cluster under one pipeline and what its transfers carry."""

    intra_node: Link = field(default_factory=Link)
    """Between GPUs of one node (e.g. NVLink: 200e9 B/s, 5e-6 s)."""
    inter_node: Link = field(default_factory=Link)
    """Between nodes, per GPU (e.g. one 200 Gb/s InfiniBand NIC per GPU: 25e9 B/s, 1e-5 s)."""
    gpus_per_node: int = 8
    """GPUs in one node."""
    gpus_per_rank: int = 1
    """GPUs behind one pipeline rank: tp x dp x cp (pp is the mesh's outermost dimension)."""
    tensor_parallel: int = 1
    """TP degree (a divisor of ``gpus_per_rank``): a rank's compute and its transfers split tp ways."""
    context_parallel: int = 1
    """CP degree (``gpus_per_rank`` a multiple of it x tp): a rank's compute and its transfers split cp
    ways, plus every unit's K/V collectives."""
    microbatch_size: int = 1
    """Sequences per microbatch."""
    activation_bytes: int = 2
    """Bytes per activation element on the wire (bf16)."""
    parameter_bytes: int = 4
    """Bytes per parameter and gradient element in the copies' all-reduces (fp32)."""
    flops_per_gpu: float = 0.0
    """Achieved FLOP/s of one GPU, to convert the cost model's unit into seconds; 0: unknown
    (allowed only with free links or a cost file in seconds)."""

    def __post_init__(self) -> None:
        g, n, tp, cp = self.gpus_per_rank, self.gpus_per_node, self.tensor_parallel, self.context_parallel
        if min(g, n, tp, cp, self.microbatch_size) < 1 or g % (tp * cp) or (n % g and g % n):
            raise ValueError(
                f"network: gpus_per_node {n}, gpus_per_rank {g}, tensor_parallel {tp}, context_parallel {cp}, "
                f"microbatch_size {self.microbatch_size}: all >= 1, tensor_parallel x context_parallel dividing "
                "gpus_per_rank, and one of gpus_per_node and gpus_per_rank a multiple of the other"
            )

    @property
    def free(self) -> bool:
        """True when every transfer takes no time (the simulator's timings without communication)."""
        return self.intra_node.free and self.inter_node.free

    def node(self, rank: int) -> int:
        """The node of pipeline rank ``rank`` (its first GPU's; the others share it or lie beyond)."""
        return rank * self.gpus_per_rank // self.gpus_per_node

    def link(self, a: int, b: int) -> Link:
        """The link between pipeline ranks ``a`` and ``b`` (same other coordinates)."""
        return self.intra_node if a != b and self.node(a) == self.node(b) else self.inter_node

    def seconds_per_time_unit(self, args: TransformerModelArgs, cost: UnitCost, seq_len: int, pp: int) -> float:
        """Seconds of the simulator's unit (one microbatch's forward on 1/p of the layers)
        for a model of ``args`` (torchtitan ``TransformerModelArgs``)."""
        if self.flops_per_gpu <= 0:
            raise ValueError(
                "links that cost time need the GPUs' achieved FLOP/s to convert the cost model's unit "
                "into seconds: set flops_per_gpu (--flops-per-gpu), or use a cost file in seconds"
            )
        flops = self.microbatch_size * args.n_layers * cost.forward(seq_len, 0)
        return flops / (pp * self.tensor_parallel * self.context_parallel * self.flops_per_gpu)

    def kv_collective_seconds(self, args: TransformerModelArgs, length: int) -> float:
        """One layer's all-gather of a unit's K/V over the CP group (its gradient's reduce-scatter moves the
        same): c - 1 ring steps, each a rank's share, b L / c tokens of K and V, over the CP link."""
        c = self.context_parallel
        if c == 1:
            return 0.0
        kv = kv_values(args) / self.tensor_parallel
        share = self.microbatch_size * length / c * kv * self.activation_bytes
        link = self.intra_node if c * self.tensor_parallel <= self.gpus_per_node else self.inter_node
        return (c - 1) * link.seconds(share)


def parameter_count(args: TransformerModelArgs, active: bool = False) -> int:
    """Parameters of the model of ``args`` (torchtitan ``TransformerModelArgs`` or a model shape of any
    family), the output layer apart from the embeddings: every expert's, or (``active``) those a token
    runs through."""
    return round(chunk_parameters(args, args.n_layers, True, True, active=active))


@dataclass(frozen=True)
class Transfers:
    """The communication times of one simulated step, in the simulator's unit of time.

    Built by :meth:`for_model`; :mod:`.engine` asks it for each SEND
    (:meth:`send`) and for the copies' all-reduces at the end of the step
    (:meth:`copy_sync`).
    """

    network: Network
    unit_bytes: tuple[float, ...]
    """Bytes a SEND of subsequence j carries (activations or their gradient), per GPU (a TP and CP rank's share)."""
    chunk_bytes: float
    """Parameter bytes of one model chunk per GPU (1/num_chunks of the model, / tp)."""
    seconds_per_time_unit: float

    @classmethod
    def for_model(
        cls,
        network: Network,
        args: TransformerModelArgs,
        lengths: list[int],
        num_chunks: int,
        seconds_per_time_unit: float,
    ) -> Transfers:
        """Transfers of a model of ``args`` cut into ``num_chunks`` equal chunks (the cost model's
        equal stages), its sequences into subsequences of ``lengths``."""
        tp = network.tensor_parallel
        per_token = network.microbatch_size * args.dim * network.activation_bytes / (tp * network.context_parallel)
        chunk = parameter_count(args) / num_chunks * network.parameter_bytes / tp
        return cls(network, tuple(length * per_token for length in lengths), chunk, seconds_per_time_unit)

    def send(self, src: int, dst: int, subsequence: int) -> float:
        """From a SEND of unit ``subsequence`` on rank ``src`` to its data on rank ``dst``."""
        return self.network.link(src, dst).seconds(self.unit_bytes[subsequence]) / self.seconds_per_time_unit

    def copy_sync(self, ranks: tuple[int, ...], shared_chunks: int) -> float:
        """The gradient and then the parameter all-reduce of ``shared_chunks`` chunks over
        ``ranks`` (a ring: 2 (n - 1) steps of 1/n of the buffer over its slowest link)."""
        n = len(ranks)
        size = shared_chunks * self.chunk_bytes / n
        step = max(self.network.link(a, b).seconds(size) for a, b in zip(ranks, ranks[1:] + ranks[:1]))
        return 2 * (2 * (n - 1) * step) / self.seconds_per_time_unit
