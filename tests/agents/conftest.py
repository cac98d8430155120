from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# tiny_chat_models (this folder) is imported by module name from the tests of every sub-folder
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
