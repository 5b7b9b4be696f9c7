"""TensorBoard event files read back (EventAccumulator, every point kept)."""

from __future__ import annotations

from pathlib import Path


def histograms(tb_dir: Path) -> dict[str, list[tuple[int, float, float, float]]]:
    """tag -> [(step, count, min, max)] of every TensorBoard histogram."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"histograms": 0})
    acc.Reload()
    return {
        tag: [
            (e.step, e.histogram_value.num, e.histogram_value.min, e.histogram_value.max) for e in acc.Histograms(tag)
        ]
        for tag in acc.Tags()["histograms"]
    }


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
