"""What a training run leaves on disk, read back: JSONL logs and the samples trained per epoch."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

from dflash_dist.trainer.loop import SAMPLE_LOG


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def consumed_per_epoch(out: Path) -> dict[int, Counter]:
    """epoch -> how often each sample key was trained, over every rank's sample log."""
    per: dict[int, Counter] = {}
    for log in sorted((out / SAMPLE_LOG).glob("rank_*.jsonl")):
        for row in read_jsonl(log):
            per.setdefault(row["epoch"], Counter()).update(row["keys"])
    return per


def cli_run_thread(argv: list[str], code: list) -> threading.Thread:
    """`launcher.cli.main(argv)` in a started daemon thread of this process (a run joins this process's Ray
    cluster); its exit code, or what it raised, is appended to `code` for the test's thread."""
    from launcher import cli

    def main() -> None:
        try:
            code.append(cli.main(argv))
        except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
            code.append(e)

    thread = threading.Thread(target=main, name="dflash-dist run", daemon=True)
    thread.start()
    return thread
