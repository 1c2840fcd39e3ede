"""Entry point: ``torchrun ... -m torchtitan_seq.train --job.config_file FILE [overrides]``.

Same command line as ``torchtitan.train``; it registers torchtitan_seq with
torchtitan and merges the ``[sequence_pipeline]`` config section when the job
does not name a custom config module itself.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torchtitan_seq  # noqa: E402,F401  (CPU compatibility before torchtitan)
from torchtitan.train import main  # noqa: E402

from .registration import register  # noqa: E402
from .trainer import SeqTrainer  # noqa: E402

CONFIG_MODULE = "torchtitan_seq.config"


def _with_config_module(argv: list[str]) -> list[str]:
    named = any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module") for a in argv)
    return argv if named else [*argv, "--job.custom_config_module", CONFIG_MODULE]


if __name__ == "__main__":
    sys.argv[1:] = _with_config_module(sys.argv[1:])
    register()
    main(SeqTrainer)
