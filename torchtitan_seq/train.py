"""Entry point: ``torchrun ... -m torchtitan_seq.train [args]``, for the installed torchtitan.

The same command line as that version's ``torchtitan.train``, with torchtitan_seq registered:
torchtitan 0.2.2 takes ``--job.config_file FILE [overrides]`` (with the arguments :func:`resolve_args`
gives), torchtitan 0.3 ``--module torchtitan_seq.recipes --config F [overrides]``
(:mod:`torchtitan_seq.recipes`). ``python -m torchtitan_seq.train --check [args]`` only checks the job
for ``WORLD_SIZE`` processes and exits: 0, or 2 with one line naming the setting at fault
(run_train.sh does this before it starts torchrun).
"""

from __future__ import annotations

import logging
import os
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan_seq.assets import TOKENIZER_DIR
from torchtitan_seq.titan.version import TITAN_03


def _option(argv: list[str], toml: dict, section: str, key: str) -> str | None:
    """``--section.key`` (underscores or dashes; ``=value`` or the next word) if given, else the TOML's."""
    names = (f"--{section}.{key}", f"--{section}.{key.replace('_', '-')}")
    given = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names:
            given = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            break
    return given or toml.get(section, {}).get(key)


def resolve_args(argv: list[str]) -> list[str]:
    """The command line torchtitan 0.2.2 should see, torchtitan_seq's defaults added.

    ``--job.custom_config_module torchtitan_seq.config`` is added unless the command line or the TOML
    (``--job.config_file``) names a module, and a ``model.hf_assets_path`` of ``builtin`` is resolved to
    the shipped tokenizer's folder.

    Args:
        argv: the arguments after the program's name (``--check`` taken out).

    Returns:
        ``argv``, followed by the arguments added.
    """
    toml: dict = {}
    config_file = _option(argv, toml, "job", "config_file")
    if config_file and os.path.isfile(config_file):
        with open(config_file, "rb") as f:
            toml = tomllib.load(f)
    extra = []
    if not _option(argv, toml, "job", "custom_config_module"):
        extra += ["--job.custom_config_module", "torchtitan_seq.config"]
    if _option(argv, toml, "model", "hf_assets_path") == "builtin":
        extra += ["--model.hf_assets_path", str(TOKENIZER_DIR)]
    return [*argv, *extra]


CHECK_ONLY = False
if __name__ == "__main__":
    # torchtitan 0.2.2's ConfigManager captures sys.argv when it is imported.
    CHECK_ONLY = "--check" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--check"]
    sys.argv[1:] = args if TITAN_03 else resolve_args(args)

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torchtitan_seq.titan import cpu_compat  # noqa: E402

cpu_compat.apply()  # before torchtitan is imported

from torchtitan_seq.runtime.torch_internals import keep_async_collective_input_grads  # noqa: E402

keep_async_collective_input_grads()  # compiled blocks under TP get their first input's gradient, any schedule

from torchtitan.config import ConfigManager  # noqa: E402

if TITAN_03:
    from torchtitan.train import main as titan_main

    from torchtitan_seq.titan.v03.job_check import check_job
    from torchtitan_seq.titan.v03.registration import register
else:
    from torchtitan.train import main as titan_main_022

    from torchtitan_seq.titan.v022.job_check import check_job
    from torchtitan_seq.titan.v022.registration import register
    from torchtitan_seq.titan.v022.trainer import SeqTrainer

    def titan_main() -> None:
        titan_main_022(SeqTrainer)


if __name__ == "__main__":
    register()
    if CHECK_ONLY:
        try:
            check_job(ConfigManager().parse_args(), int(os.environ.get("WORLD_SIZE", "1")))
        except (ValueError, FileNotFoundError, ImportError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    titan_main()
    # torchtitan has closed its writers and the process group; skip the interpreter's teardown,
    # whose C++ static destructors sometimes abort a finished run with exit code -6 ("terminate
    # called without an active exception", a joinable native thread of the pyarrow datasets load).
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
