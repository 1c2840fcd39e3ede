"""The ``[sequence_pipeline]`` section: how sequence schedules cut and run a job, the same fields under
every torchtitan version (0.2.2's TOML and :mod:`torchtitan_seq.config`, 0.3's config functions)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_seq.attention.kernels import AttentionBackend
from torchtitan_seq.runtime.partition import Partition
from torchtitan_seq.runtime.reach import KVContextMode
from torchtitan_seq.runtime.shape import LENGTH_MULTIPLE
from torchtitan_seq.schedules.bidirectional import Placement

__all__ = ["SequencePipeline"]


@dataclass
class SequencePipeline:
    """How sequence schedules (``Seq1F1B``, ``InterleavedSeq1F1B``, ``BSIPipe``, ``Chimera``,
    ``TeraPipe``) cut and run each microbatch; torch's own schedules ignore it."""

    num_subsequences: int = 4
    """k: subsequences each microbatch's sequence is cut into."""

    partition: Partition = "compute"
    """'compute' (every unit costs the same forward + backward), 'even' (equal lengths) or 'latency'
    (TeraPipe's slicing, the least pipeline latency), as :mod:`torchtitan_seq.runtime.partition` cuts."""

    expected_document_length: int = 0
    """Block-causal flavors (packed documents): the mean tokens per document, which the
    'compute' and 'latency' partitions cost attention by (a query reaches back about that many
    keys); 0 costs attention as causal, as if a sequence were one document."""

    length_multiple: int = LENGTH_MULTIPLE
    """Every subsequence length is a multiple of this and of the TP degree (default 1: any length;
    GPU kernels prefer multiples of 64 or 128, which the shipped configs set)."""

    split_backward: bool = False
    """Run each unit's backward as separate input- and weight-gradient passes."""

    attention_backend: AttentionBackend = "auto"
    """'auto' (on CUDA: torch's cuDNN kernel on Hopper, else flash-attn when installed, else
    torch's flash kernel), 'flash' (flash-attn) or 'sdpa' (torch's kernels)."""

    kv_context: KVContextMode = "reach"
    """What each layer's K/V context keeps of earlier subsequences: 'reach' (only the positions a later
    subsequence can still read: a sliding window's last positions, the current attention chunk; every
    position for full attention), 'full' (every earlier position, whatever the layer reads) or 'latent'
    (MLA models, DeepSeek-V3: each earlier position's compressed latent and RoPE key, kv_lora_rank +
    qk_rope_head_dim values a token and layer, expanded into keys and values by each subsequence)."""

    kv_offload: bool = False
    """Copy the K/V context of microbatches that no pass of the stage reads for a while (between a
    microbatch's last forward and first backward, mostly) to host memory and back before the pass that reads
    it, overlapped with compute (on CUDA a side stream and pinned host memory; on a CPU device the copies run
    as issued): less device memory for the K/V of long sequences, at the cost of host-link copies
    (:mod:`torchtitan_seq.runtime.kv_offload`; the planner proposes it where it makes a sequence fit)."""

    bidirectional_placement: Placement = "paired"
    """BSIPipe and Chimera only: 'paired' puts each mirrored pair of pipeline positions
    (q, p - 1 - q), whose gradients are all-reduced, on neighbouring ranks; 'linear' puts
    position q on pipeline rank q."""

    activation_memory_freq: int = 10
    """Meter saved activations (:mod:`torchtitan_seq.instrumentation.memory`) on the first logged step
    (step 1) and on every N-th logged step after it: the steps that are multiples of N x
    ``metrics.log_freq`` (numbered as torchtitan numbers steps, so a resumed job meters the same ones).
    The meter is a saved-tensor hook on every tensor autograd saves, which slows the steps it runs in;
    other steps install none, and their records carry no activation figure. 1: every logged step
    (the benchmark, and tests that read peaks); 0: never."""

    pipeline_timeline: bool = True
    """Time every compute action of the logged steps (:mod:`torchtitan_seq.instrumentation.timeline`:
    their bubble ratio and pipeline makespan, the exported timeline); other steps are never timed.
    False: no step is (the benchmark's instrumentation-off control)."""
