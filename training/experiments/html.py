"""What both HTML reports (one run's, and an arms set's) are made of: the page, escaping, inline plots.

A report is one self-contained file: no network, no script, no JavaScript library. Plots are inline
SVG drawn by :func:`svg_plot`; every value read from a run file reaches the page through :func:`text`
(escaped, quotes included) or :func:`num` (a number, or whatever else the field holds shown as text),
since a run directory may come from anyone.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["COLORS", "html_page", "num", "number", "read_jsonl", "svg_plot", "text"]

#: The page's common style; each report adds its own rules.
STYLE = """body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
figure.plot { margin: 0; border: 1px solid #ddd; padding: .4em; }
figcaption { font-weight: 600; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: .2em .6em; }"""


def html_page(title: str, style: str, body: str) -> str:
    """A whole page: the shared head and style, ``style``'s rules after it, then ``body`` (already HTML).

    ``style`` is written with doubled braces (it comes from the reports' f-strings), undone here.
    """
    extra = style.replace("{{", "{").replace("}}", "}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{text(title)}</title>
<style>
{STYLE}
{extra}
</style></head>
<body>
{body.strip()}
</body></html>
"""


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a run's JSONL file (none when it does not exist); a line that is not JSON is a
    ``ValueError`` naming ``file:line``, never a bare decoder traceback."""
    if not path.exists():
        return []
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not a JSON line ({exc})") from None
    return records


def text(value: Any) -> str:
    """A value from a run file as HTML text: escaped, quotes included (safe in attributes too)."""
    return html.escape(str(value))


def num(value: Any, spec: str) -> str:
    """A number from a run file formatted with ``spec``; any other value (a damaged or planted field)
    is shown as escaped text rather than breaking the page."""
    if isinstance(value, int | float):
        return format(value, spec)
    return text(value)


def number(value: Any) -> float:
    """A metric value as a float; anything that is not a number is a gap (NaN) in its plot."""
    return float(value) if isinstance(value, int | float) else math.nan


def svg_plot(
    title: str, steps: list[float], series: dict[str, list[float]], width: int = 460, height: int = 220
) -> str:
    left, right, top, bottom = 48, 10, 24, 28
    values = [v for ys in series.values() for v in ys if not math.isnan(v)]
    if not steps or not values:
        return f'<figure class="plot"><figcaption>{html.escape(title)}</figcaption><p>no data</p></figure>'
    lo, hi = min(values), max(values)
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    x0, x1 = min(steps), max(steps)
    span = (x1 - x0) or 1.0

    def sx(x: float) -> float:
        return left + (x - x0) / span * (width - left - right)

    def sy(y: float) -> float:
        return top + (hi - y) / (hi - lo) * (height - top - bottom)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
        f'<text x="4" y="{top + 4}" font-size="10">{hi:.3g}</text>',
        f'<text x="4" y="{height - bottom}" font-size="10">{lo:.3g}</text>',
        f'<text x="{left}" y="{height - 8}" font-size="10">step {x0:g}</text>',
        f'<text x="{width - right - 50}" y="{height - 8}" font-size="10">step {x1:g}</text>',
    ]
    for i, (name, ys) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        points = " ".join(
            f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(steps, ys, strict=True) if not math.isnan(y)
        )
        parts.append(
            f'<polyline class="series" data-key="{html.escape(name)}" fill="none" stroke="{color}" stroke-width="2" points="{points}"/>'
        )
        parts.append(
            f'<text x="{left + 8 + 150 * (i % 3)}" y="{14 + 12 * (i // 3)}" font-size="11" fill="{color}">{html.escape(name)}</text>'
        )
    parts.append("</svg>")
    return f'<figure class="plot"><figcaption>{html.escape(title)}</figcaption>{"".join(parts)}</figure>'
