"""Entry point: ``torchrun ... -m torchtitan_seq.train --job.config_file FILE [overrides]``.

Same command line as ``torchtitan.train``; it registers torchtitan_seq with
torchtitan, merges the ``[sequence_pipeline]`` config section when the job
names no custom config module, and resolves ``hf_assets_path = "builtin"`` to
the tokenizer shipped in the package.

``python -m torchtitan_seq.train --check [args]`` only checks the job for
``WORLD_SIZE`` processes and exits: 0, or 2 with one line naming the setting
at fault (run_train.sh does this before it starts torchrun).
"""

from __future__ import annotations

import logging
import os
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .assets import TOKENIZER_DIR

CONFIG_MODULE = "torchtitan_seq.config"
BUILTIN_ASSETS = "builtin"


def _option(argv: list[str], *names: str) -> str | None:
    """Value of a ``--name value`` or ``--name=value`` option, if given."""
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def resolve_args(argv: list[str]) -> list[str]:
    """The command line torchtitan should see.

    Adds ``--job.custom_config_module torchtitan_seq.config`` unless the
    command line or the TOML names a module, and replaces the assets path
    ``builtin`` by the shipped tokenizer's folder.
    """
    toml: dict = {}
    config_file = _option(argv, "--job.config_file", "--job.config-file")
    if config_file and os.path.isfile(config_file):
        with open(config_file, "rb") as f:
            toml = tomllib.load(f)
    extra = []
    if not (
        _option(argv, "--job.custom_config_module", "--job.custom-config-module")
        or toml.get("job", {}).get("custom_config_module")
    ):
        extra += ["--job.custom_config_module", CONFIG_MODULE]
    assets = _option(argv, "--model.hf_assets_path", "--model.hf-assets-path")
    if (assets or toml.get("model", {}).get("hf_assets_path")) == BUILTIN_ASSETS:
        extra += ["--model.hf_assets_path", str(TOKENIZER_DIR)]
    return [*argv, *extra]


CHECK_ONLY = False
if __name__ == "__main__":
    # torchtitan's ConfigManager captures sys.argv when it is imported.
    CHECK_ONLY = "--check" in sys.argv
    sys.argv[1:] = [a for a in resolve_args(sys.argv[1:]) if a != "--check"]

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from . import cpu_compat  # noqa: E402

cpu_compat.apply()  # before torchtitan is imported

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.train import main  # noqa: E402

from .registration import register  # noqa: E402
from .trainer import SeqTrainer, check_job  # noqa: E402


def _check() -> int:
    try:
        check_job(ConfigManager().parse_args(), int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    register()
    if CHECK_ONLY:
        sys.exit(_check())
    main(SeqTrainer)
    # The job is over: torchtitan has closed its writers and destroyed the
    # process group. The interpreter's own teardown then runs C++ static
    # destructors, where a joinable native thread (seen with the pyarrow that
    # torchtitan's datasets load) sometimes aborts a finished run with
    # "terminate called without an active exception" and exit code -6.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
