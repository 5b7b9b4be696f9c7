"""The Python standard library's own source as a corpus present on every machine.

The tiny default target (``tiny_target.py``) is trained on it and its chat data is cut from it,
so a fresh checkout can train and evaluate a drafter without downloading anything. Everything
here is deterministic: the file list is sorted, the train/heldout split hashes the relative path,
and sampling uses a seeded ``random.Random``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from data_pipeline.durable_files import write_text_atomic

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")

# Directories that are tests, third-party code, bundled apps or generated data tables.
EXCLUDED_DIRS = frozenset(
    {
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "idlelib",
        "turtledemo",
        "ensurepip",
        "pydoc_data",  # one 750 KB dict of documentation strings
        "encodings",  # generated charmap tables
        "lib-dynload",
    }
)
EXCLUDED_NAME_PREFIXES = ("_sysconfigdata", "test_")
HELDOUT_PER_MILLE = 100  # 10% of files are held out

# Chat sample shape: a prompt of whole source lines, then the next lines as the response.
# Character caps (and ASCII only) keep prompt + response around 64-200 tokens of the tiny tokenizer.
PROMPT_LINES = (4, 12)
RESPONSE_LINES = (2, 8)
PROMPT_MAX_CHARS = 260
RESPONSE_MAX_CHARS = 160
MIN_RESPONSE_CHARS = 40
WINDOW_STRIDE_LINES = 16


@dataclass(frozen=True)
class StdlibFile:
    """One corpus file: ``relpath`` (posix, relative to the stdlib root) names it everywhere."""

    relpath: str
    path: Path

    @property
    def split(self) -> Split:
        return split_of(self.relpath)


def stdlib_root() -> Path:
    """The running interpreter's stdlib directory (the corpus differs across Python versions)."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> Split:
    """Stable split from the path alone, so adding or removing files never moves others."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE else "train"


def _excluded(relparts: tuple[str, ...]) -> bool:
    name = relparts[-1]
    if name.startswith(EXCLUDED_NAME_PREFIXES):
        return True
    return any(part in EXCLUDED_DIRS or part.startswith("config-") for part in relparts[:-1])


def list_stdlib_files(root: Path | None = None, split: Split | None = None) -> list[StdlibFile]:
    """All corpus ``.py`` files under ``root`` sorted by relpath, optionally one split only."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"stdlib directory {root} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            relparts = path.relative_to(root).parts
            if _excluded(relparts):
                continue
            relpath = "/".join(relparts)
            if split is None or split_of(relpath) == split:
                files.append(StdlibFile(relpath=relpath, path=path))
    files.sort(key=lambda f: f.relpath)
    return files


def read_source(file: StdlibFile) -> str | None:
    """The file's text, or None if it is not UTF-8 (a few legacy files are not)."""
    try:
        return file.path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def iter_sources(files: list[StdlibFile]) -> Iterator[tuple[StdlibFile, str]]:
    """(file, text) for every readable file, in the given order."""
    for file in files:
        text = read_source(file)
        if text is not None and text.strip():
            yield file, text


def corpus_hash(files: list[StdlibFile]) -> str:
    """sha256 over relpaths and contents: names the exact corpus a model was trained on."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.relpath.encode("utf-8") + b"\0")
        digest.update(hashlib.sha256(file.path.read_bytes()).digest())
    return digest.hexdigest()


def _take_lines(lines: list[str], start: int, count: int, max_chars: int) -> list[str]:
    """Up to ``count`` lines from ``start`` whose total length stays within ``max_chars``."""
    taken: list[str] = []
    used = 0
    for line in lines[start : start + count]:
        if used + len(line) > max_chars:
            break
        taken.append(line)
        used += len(line)
    return taken


def code_chat_samples(split: Split, max_samples: int, seed: int) -> list[dict]:
    """Chat conversations continuing stdlib code: user shows lines, assistant gives the next.

    Windows start every WINDOW_STRIDE_LINES lines of every file of the split; a seeded shuffle
    picks which ones (and their lengths), so the samples spread over the whole split.
    """
    if max_samples < 0:
        raise ValueError(f"max_samples must be >= 0, got {max_samples}")
    rng = random.Random(seed)
    sources = [(f.relpath, text.splitlines(keepends=True)) for f, text in iter_sources(list_stdlib_files(split=split))]
    windows = [
        (i, start) for i, (_, lines) in enumerate(sources) for start in range(0, len(lines), WINDOW_STRIDE_LINES)
    ]
    rng.shuffle(windows)
    samples: list[dict] = []
    for file_index, start in windows:
        if len(samples) >= max_samples:
            break
        relpath, lines = sources[file_index]
        prompt = _take_lines(lines, start, rng.randint(*PROMPT_LINES), PROMPT_MAX_CHARS)
        response = _take_lines(lines, start + len(prompt), rng.randint(*RESPONSE_LINES), RESPONSE_MAX_CHARS)
        prompt_text, response_text = "".join(prompt).rstrip("\n"), "".join(response).rstrip("\n")
        if not prompt_text.strip() or len(response_text.strip()) < MIN_RESPONSE_CHARS:
            continue
        if not (prompt_text.isascii() and response_text.isascii()):
            continue  # non-ASCII text costs several byte tokens per character
        messages = [
            {"role": "user", "content": f"Continue this code from {relpath}:\n{prompt_text}"},
            {"role": "assistant", "content": response_text},
        ]
        samples.append({"messages": messages, "source": relpath, "start_line": start + 1})
    return samples


def write_chat_jsonl(path: str | os.PathLike, split: Split, max_samples: int, seed: int) -> int:
    """Write ``code_chat_samples`` as JSONL atomically (temp file + rename); returns the count."""
    path = Path(path)
    samples = code_chat_samples(split, max_samples, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(sample, ensure_ascii=False) + "\n" for sample in samples))
    return len(samples)
