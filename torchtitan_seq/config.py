"""The ``[sequence_pipeline]`` section of a torchtitan job config.

torchtitan merges this module's ``JobConfig`` into its own when a job names it (``[job]
custom_config_module = "torchtitan_seq.config"``; ``torchtitan_seq.train`` adds it for you), so every
field is settable from TOML and from the command line, e.g. ``--sequence_pipeline.num_subsequences 4``.
"""

from dataclasses import dataclass, field

from torchtitan_seq.titan.config import SequencePipeline

__all__ = ["SequencePipeline", "JobConfig"]


@dataclass
class JobConfig:
    """torchtitan's job config gains the ``[sequence_pipeline]`` section."""

    sequence_pipeline: SequencePipeline = field(default_factory=SequencePipeline)
