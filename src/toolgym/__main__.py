"""``python -m toolgym`` (and ``torchrun ... -m toolgym train ...``): the ``toolgym`` command."""

from __future__ import annotations

import sys

from toolgym.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
