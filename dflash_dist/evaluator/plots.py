"""The evaluator's TensorBoard images, drawn with PIL and numpy (matplotlib is not a dependency):
tau vs step for the chain and each DDTree budget, and a checkpoint's acceptance histogram.

Each function returns an HWC uint8 array for `Metrics.image`. Plain drawing: axes, a few ticks,
one colour per series, a legend; dashed horizontal lines for the reference drafter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 640, 400
_MARGIN = (56, 28, 20, 40)  # left, top, right, bottom
_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
            (227, 119, 194), (127, 127, 127)]


def _frame(title: str):
    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    draw.text((_MARGIN[0], 6), title, fill="black", font=font)
    left, top, right, bottom = _MARGIN[0], _MARGIN[1], WIDTH - _MARGIN[2], HEIGHT - _MARGIN[3]
    draw.rectangle((left, top, right, bottom), outline="black")
    return img, draw, font, (left, top, right, bottom)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.2f}"


def line_plot(series: Mapping[str, Sequence[tuple[float, float]]], title: str,
              hlines: Mapping[str, float] | None = None, y_label: str = "tau") -> np.ndarray:
    """One line (with point markers) per series of (x, y); `hlines` dashed, same colour order."""
    img, draw, font, (left, top, right, bottom) = _frame(title)
    points = [p for s in series.values() for p in s]
    ys = [y for _, y in points] + list((hlines or {}).values())
    xs = [x for x, _ in points] or [0.0, 1.0]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    pad = max((y1 - y0) * 0.1, 0.1)
    y0, y1 = y0 - pad, y1 + pad

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    for v in _ticks(y0, y1):
        _, py = at(x0, v)
        draw.line((left - 4, py, left, py), fill="black")
        draw.text((4, py - 6), _fmt(v), fill="black", font=font)
    for v in _ticks(x0, x1):
        px, _ = at(v, y0)
        draw.line((px, bottom, px, bottom + 4), fill="black")
        draw.text((px - 10, bottom + 6), _fmt(v), fill="black", font=font)
    draw.text((left, HEIGHT - 14), f"step    (y: {y_label})", fill="black", font=font)
    names = list(series) + [f"{k} (reference)" for k in (hlines or {})]
    for i, pts in enumerate(series.values()):
        colour = _COLOURS[i % len(_COLOURS)]
        pix = [at(x, y) for x, y in sorted(pts)]
        if len(pix) > 1:
            draw.line(pix, fill=colour, width=2)
        for px, py in pix:
            draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill=colour)
    for i, (_, y) in enumerate((hlines or {}).items()):
        colour = _COLOURS[i % len(_COLOURS)]
        _, py = at(x0, y)
        for sx in range(int(left), int(right), 12):
            draw.line((sx, py, min(sx + 6, right), py), fill=colour, width=1)
    for i, name in enumerate(names):
        colour = _COLOURS[(i if i < len(series) else i - len(series)) % len(_COLOURS)]
        ly = top + 6 + 14 * i
        draw.line((right - 150, ly + 6, right - 134, ly + 6), fill=colour, width=2)
        draw.text((right - 130, ly), name, fill="black", font=font)
    return np.asarray(img, dtype=np.uint8)


def bar_plot(values: Sequence[float], title: str, x_label: str = "accepted drafts") -> np.ndarray:
    """Bars for values[0..n-1] at x = 0..n-1 (the chain rounds by accepted drafts)."""
    img, draw, font, (left, top, right, bottom) = _frame(title)
    n = max(len(values), 1)
    peak = max(max(values, default=0), 1)
    width = (right - left) / n
    for i, v in enumerate(values):
        h = (bottom - top - 10) * v / peak
        x = left + i * width
        draw.rectangle((x + 2, bottom - h, x + width - 2, bottom), fill=_COLOURS[0])
        draw.text((x + width / 2 - 4, bottom + 6), str(i), fill="black", font=font)
        draw.text((x + width / 2 - 8, bottom - h - 14), _fmt(v), fill="black", font=font)
    draw.text((left, HEIGHT - 14), x_label, fill="black", font=font)
    return np.asarray(img, dtype=np.uint8)
