"""``python -m torchtitan_seq.simulate``: see :mod:`.cli`."""

from .cli import main

raise SystemExit(main())
