"""Which torchtitan is installed, read from its package metadata (importing torchtitan is slow and,
before :mod:`torchtitan_seq.titan.cpu_compat` on a CPU, too early)."""

from __future__ import annotations

import importlib.metadata

__all__ = ["TITAN_03"]

TITAN_03: bool = tuple(int(n) for n in importlib.metadata.version("torchtitan").split(".")[:2]) >= (0, 3)
"""Whether the installed torchtitan is 0.3 or later (config functions, :mod:`torchtitan_seq.titan.v03`),
else 0.2.2 (TOML configs)."""
