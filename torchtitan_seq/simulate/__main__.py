"""``python -m torchtitan_seq.simulate``: see :mod:`.cli`."""

from torchtitan_seq.simulate.cli import main

raise SystemExit(main())
