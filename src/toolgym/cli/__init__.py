"""The ``toolgym`` command: the composition root, the one place that may import every layer.

``main`` parses the command line and dispatches (:mod:`toolgym.cli.main`); the evaluation commands
(``eval``, ``compare``, ``reverify``, ``audit-env``) live in :mod:`toolgym.cli.eval_commands`, the
``results`` commands in :mod:`toolgym.cli.results_commands`, and
``templates/`` holds what ``toolgym new-env`` writes. Each command imports what it needs when it runs,
so ``toolgym envs`` does not import torch.
"""

from __future__ import annotations

from toolgym.cli.main import main, render_template

__all__ = ["main", "render_template"]
