"""``python -m adaptipe.cli``: the ``adaptipe`` command."""

from __future__ import annotations

import sys

from adaptipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
