from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the toy environment module is imported by name through gymnasium's "module:id" form
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
