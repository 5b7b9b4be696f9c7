"""The Python standard library's own source as a corpus present on every machine, and the
source-corpus pieces the project's learned targets share (file records, the split, chat samples).

The tiny default target (``tiny_target.py``) is trained on the stdlib and its chat data is cut
from it, so a fresh checkout can train and evaluate a drafter without downloading anything; the
mid-size code target (``code_corpus.py``, ``code_target.py``) adds installed packages' sources
and cuts longer chats with the same code. Everything here is deterministic: file lists are
sorted, the train/heldout split hashes the relative path, and sampling uses a seeded
``random.Random``.
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


@dataclass(frozen=True)
class ChatShape:
    """How a code-continuation chat is cut: a prompt of whole source lines, then the next lines
    as the response; line counts drawn from the ranges, then capped by characters."""

    prompt_lines: tuple[int, int]
    response_lines: tuple[int, int]
    prompt_max_chars: int
    response_max_chars: int
    min_response_chars: int
    window_stride_lines: int = 16  # a window may start every this many lines of a file


# The tiny target's: caps (and ASCII only) keep prompt + response around 64-200 tokens of the tiny tokenizer.
TINY_CHAT = ChatShape(
    prompt_lines=(4, 12), response_lines=(2, 8), prompt_max_chars=260, response_max_chars=160, min_response_chars=40
)


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: ``relpath`` (posix; relative to the stdlib root, or to the directory
    holding an installed package) names it everywhere, the split included."""

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


def check_split(split: Split | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def list_stdlib_files(root: Path | None = None, split: Split | None = None) -> list[SourceFile]:
    """All corpus ``.py`` files under ``root`` sorted by relpath, optionally one split only."""
    check_split(split)
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
                files.append(SourceFile(relpath=relpath, path=path))
    files.sort(key=lambda f: f.relpath)
    return files


def read_source(file: SourceFile) -> str | None:
    """The file's text, or None if it is not UTF-8 (a few legacy files are not)."""
    try:
        return file.path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def iter_sources(files: list[SourceFile]) -> Iterator[tuple[SourceFile, str]]:
    """(file, text) for every readable file, in the given order."""
    for file in files:
        text = read_source(file)
        if text is not None and text.strip():
            yield file, text


def corpus_hash(files: list[SourceFile]) -> str:
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
    """The tiny target's chats: ``chat_samples`` over the stdlib files of ``split``."""
    check_split(split)
    sources = [(f.relpath, text) for f, text in iter_sources(list_stdlib_files(split=split))]
    return chat_samples(sources, max_samples, seed, TINY_CHAT)


def chat_samples(sources: list[tuple[str, str]], max_samples: int, seed: int, shape: ChatShape) -> list[dict]:
    """Chat conversations continuing code: user shows lines, assistant gives the next.

    ``sources`` are (relpath, text) pairs. Windows start every ``shape.window_stride_lines``
    lines of every file; a seeded shuffle picks which ones (and their lengths), so the samples
    spread over all the files.
    """
    if max_samples < 0:
        raise ValueError(f"max_samples must be >= 0, got {max_samples}")
    rng = random.Random(seed)
    lined = [(relpath, text.splitlines(keepends=True)) for relpath, text in sources]
    windows = [
        (i, start) for i, (_, lines) in enumerate(lined) for start in range(0, len(lines), shape.window_stride_lines)
    ]
    rng.shuffle(windows)
    samples: list[dict] = []
    for file_index, start in windows:
        if len(samples) >= max_samples:
            break
        relpath, lines = lined[file_index]
        prompt = _take_lines(lines, start, rng.randint(*shape.prompt_lines), shape.prompt_max_chars)
        response = _take_lines(lines, start + len(prompt), rng.randint(*shape.response_lines), shape.response_max_chars)
        prompt_text, response_text = "".join(prompt).rstrip("\n"), "".join(response).rstrip("\n")
        if not prompt_text.strip() or len(response_text.strip()) < shape.min_response_chars:
            continue
        if not (prompt_text.isascii() and response_text.isascii()):
            continue  # non-ASCII text costs several byte tokens per character
        messages = [
            {"role": "user", "content": f"Continue this code from {relpath}:\n{prompt_text}"},
            {"role": "assistant", "content": response_text},
        ]
        samples.append({"messages": messages, "source": relpath, "start_line": start + 1})
    return samples


def write_samples_jsonl(path: str | os.PathLike, samples: list[dict]) -> int:
    """Write chat samples as JSONL atomically (temp file + rename); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(sample, ensure_ascii=False) + "\n" for sample in samples))
    return len(samples)


def write_chat_jsonl(path: str | os.PathLike, split: Split, max_samples: int, seed: int) -> int:
    """Write ``code_chat_samples`` as JSONL atomically (temp file + rename); returns the count."""
    return write_samples_jsonl(path, code_chat_samples(split, max_samples, seed))
