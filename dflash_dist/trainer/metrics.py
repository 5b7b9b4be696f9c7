"""One metrics interface over TensorBoard (STYLE 10): namespaced scalar tags, one writer.

Only the process constructed with `enabled=True` (rank 0 of the trainer group) creates a
SummaryWriter; every other rank gets a no-op, so call sites need no rank checks. A tag outside
the known namespaces is refused, so dashboards never split over misspelled prefixes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

NAMESPACES = ("train/", "data/", "eval/")


def _check_tags(tags: Iterable[str]) -> None:
    for tag in tags:
        if not tag.startswith(NAMESPACES) or tag in NAMESPACES:
            raise ValueError(f"metric tag {tag!r} must be '<namespace>/<name>' with namespace in {NAMESPACES}")


class Metrics:
    """Scalars at a step, under `log_dir` (the trainer uses `<out>/tb/train`)."""

    def __init__(self, log_dir: str | Path, enabled: bool = True, purge_step: int | None = None) -> None:
        """purge_step: on a resume, the first step to be written again; TensorBoard drops the
        earlier attempt's points from there on instead of showing those steps twice."""
        self.log_dir = Path(log_dir)
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            # TensorBoard names its file events.out.tfevents.<seconds>.<host>.<pid>.<n> and opens it "wb"
            # through any symlink there: names that can be guessed could be planted, ahead of time, as links
            # to files elsewhere, which the writer would truncate and fill. A random suffix: nobody can.
            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=60, purge_step=purge_step,
                                         filename_suffix=f".{secrets.token_hex(8)}")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Write every scalar at `step`; non-finite values are written too (they are news)."""
        _check_tags(scalars)
        if self._writer is None:
            return
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), global_step=step)

    def histograms(self, step: int, values: Mapping[str, Sequence[float]]) -> None:
        """One TensorBoard histogram per tag at `step` (empty value lists are left out)."""
        _check_tags(values)
        if self._writer is None:
            return
        for tag, vals in values.items():
            if len(vals):
                self._writer.add_histogram(tag, np.asarray(vals, dtype=np.float64), global_step=step)

    def images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        """One TensorBoard image per tag at `step`: HWC uint8 arrays (the evaluator's plots)."""
        _check_tags(images)
        if self._writer is None:
            return
        for tag, img in images.items():
            self._writer.add_image(tag, np.asarray(img, dtype=np.uint8), global_step=step, dataformats="HWC")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
