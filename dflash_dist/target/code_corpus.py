"""The mid-size code target's corpus: the standard library plus the installed sources of the
packages this project pins, read from the running interpreter.

Where a package lives is asked of the interpreter itself (``importlib.util.find_spec``), so the
same code finds it in a virtualenv's site-packages, in the image's dist-packages, or in a
``pip install --target /tmp/site`` directory put first on PYTHONPATH (the GPU machine's wheel
set): the copy that ``import`` would load is the one read. A package file is named
``<package>/<path inside it>``; stdlib files keep their stdlib-relative names, so the split
(``stdlib_corpus.split_of``, a hash of that name) is stable when files or packages are added.

Kept out, and counted in the record instead of silently dropped: tests, files over
``MAX_FILE_BYTES`` (generated tables), files that are not UTF-8 or are empty, and exact
duplicates of an earlier file (by content; the first in name order stays). The corpus differs
between interpreters and package versions; its record (packages, versions, counts, bytes,
content hash) says which one a target was trained on.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_dist.target.stdlib_corpus import (
    SPLITS,
    ChatShape,
    SourceFile,
    Split,
    chat_samples,
    check_split,
    list_stdlib_files,
    split_of,
    stdlib_root,
    write_samples_jsonl,
)

log = logging.getLogger(__name__)

# Import names of setup.py's INSTALL_REQUIRES (flash-linear-attention and fla-core are both `fla`;
# pyyaml is `yaml`); tests/test_code_target.py checks the two lists agree. A pin the interpreter
# cannot find (the GPU machine's image lacks some) is listed as missing in the record.
PACKAGES = (
    "torch",
    "transformers",
    "fla",
    "deepspeed",
    "ray",
    "webdataset",
    "pyarrow",
    "datasets",
    "tensorboard",
    "openai",
    "safetensors",
    "numpy",
    "yaml",
    "tqdm",
    "xxhash",
    "pydantic",
    "typing_extensions",  # a single module, not a package directory: listed as not found in the record
    "rich",
    "psutil",  # pinned since 2026-12-06 (dflash_dist/node_address.py): the corpus (and its hash) changed with it
)
PACKAGE_EXCLUDED_DIRS = frozenset({"__pycache__", "test", "tests", "testing"})
PACKAGE_EXCLUDED_NAMES = ("test_", "conftest.py")
MAX_FILE_BYTES = 400_000  # larger .py files are generated tables (e.g. torch/sparse/_triton_ops_meta.py)

# The mid target's chats: with its 8k BPE (~4 bytes a token on this code) a prompt of ~240 tokens
# (p90 ~330) and a response of ~140 (up to ~250), so greedy replay walks many 16-token blocks.
MID_CHAT = ChatShape(
    prompt_lines=(8, 40), response_lines=(6, 24), prompt_max_chars=1200, response_max_chars=960, min_response_chars=120
)


@dataclass(frozen=True)
class PackageSource:
    """Where one pinned package was found and what it holds (before the corpus-wide filters)."""

    name: str
    root: str  # the directory holding the package directory (site-packages, /tmp/site, ...)
    version: str | None
    files: int


@dataclass
class CorpusRecord:
    """What the corpus is: roots, per-package counts, what was left out and why, the content hash."""

    stdlib_root: str
    packages: list[PackageSource] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=lambda: {"too_large": 0, "not_utf8": 0, "empty": 0, "duplicate": 0})
    files: dict[str, int] = field(default_factory=lambda: {"train": 0, "heldout": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"train": 0, "heldout": 0})
    hash: str = ""

    def to_json(self) -> dict:
        return {
            "stdlib_root": self.stdlib_root,
            "packages": [vars(p) for p in self.packages],
            "missing_packages": self.missing,
            "skipped": self.skipped,
            "files": self.files,
            "bytes": self.bytes,
            "hash": self.hash,
        }


@dataclass
class CodeCorpus:
    """The read corpus: (relpath, text) per split, in name order, and its record."""

    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]
    record: CorpusRecord


def package_dirs(names: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """The directory `import NAME` would load each package from (not imported; missing left out)."""
    importlib.invalidate_caches()
    found = {}
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if locations:
            found[name] = Path(locations[0])
    return found


def _version(name: str, dists_of: dict[str, list[str]]) -> str | None:
    """`dist==version` of the distribution that installed import package `name` (first by name)."""
    for dist in sorted(dists_of.get(name) or []):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _package_files(name: str, pkg_dir: Path) -> list[SourceFile]:
    files = []
    for dirpath, dirnames, filenames in os.walk(pkg_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in PACKAGE_EXCLUDED_DIRS)
        for fname in filenames:
            if fname.endswith(".py") and not fname.startswith(PACKAGE_EXCLUDED_NAMES):
                path = Path(dirpath) / fname
                files.append(SourceFile(relpath="/".join((name, *path.relative_to(pkg_dir).parts)), path=path))
    return files


def list_code_files(packages: tuple[str, ...] = PACKAGES) -> tuple[list[SourceFile], CorpusRecord]:
    """Every candidate file (stdlib + packages) sorted by relpath, and the record of where they were found."""
    stdlib = list_stdlib_files()
    record = CorpusRecord(stdlib_root=str(stdlib_root()))
    dirs = package_dirs(packages)
    record.missing = [n for n in packages if n not in dirs]
    files = list(stdlib)
    dists_of = importlib.metadata.packages_distributions()
    for name, pkg_dir in dirs.items():
        pkg_files = _package_files(name, pkg_dir)
        record.packages.append(PackageSource(name, str(pkg_dir.parent), _version(name, dists_of), len(pkg_files)))
        files += pkg_files
    if record.missing:
        log.warning(
            "code corpus: pinned packages not found by this interpreter (left out, listed in the record): %s",
            ", ".join(record.missing),
        )
    files.sort(key=lambda f: f.relpath)
    names = [f.relpath for f in files]
    if len(set(names)) != len(names):
        raise ValueError(
            "code corpus: two files share a name (a package shadowing a stdlib module?): "
            f"{sorted({n for n in names if names.count(n) > 1})[:5]}"
        )
    return files, record


def spread(files: list[SourceFile], max_files: int | None) -> list[SourceFile]:
    """At most `max_files` files evenly spread over the name order (stdlib and packages alike)."""
    if max_files is None or len(files) <= max_files:
        return files
    step = len(files) / max_files
    return [files[int(i * step)] for i in range(max_files)]


def load_code_corpus(max_files: int | None = None, packages: tuple[str, ...] = PACKAGES) -> CodeCorpus:
    """Read the corpus (at most `max_files` per split, spread over it: the test size). Both splits
    are always read, in name order, so which copy of a duplicate stays never depends on the caller."""
    files, record = list_code_files(packages)
    chosen = {
        f.relpath for split in SPLITS for f in spread([f for f in files if split_of(f.relpath) == split], max_files)
    }
    digest = hashlib.sha256()
    seen: set[bytes] = set()
    texts: dict[str, list[tuple[str, str]]] = {split: [] for split in SPLITS}
    for file in files:
        if file.relpath not in chosen:
            continue
        text = _read(file, record, seen)
        if text is None:
            continue
        split = split_of(file.relpath)
        texts[split].append((file.relpath, text))
        record.files[split] += 1
        record.bytes[split] += len(text.encode("utf-8"))
        digest.update(file.relpath.encode("utf-8") + b"\0" + hashlib.sha256(text.encode("utf-8")).digest())
    record.hash = digest.hexdigest()
    return CodeCorpus(texts["train"], texts["heldout"], record)


def _read(file: SourceFile, record: CorpusRecord, seen: set[bytes]) -> str | None:
    """The file's text, or None (counted in record.skipped) if it is left out."""
    try:
        if file.path.stat().st_size > MAX_FILE_BYTES:
            record.skipped["too_large"] += 1
            return None
        data = file.path.read_bytes()
    except OSError as err:
        raise ValueError(f"code corpus: cannot read {file.path} ({err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        record.skipped["not_utf8"] += 1
        return None
    if not text.strip():
        record.skipped["empty"] += 1
        return None
    key = hashlib.sha256(data).digest()
    if key in seen:
        record.skipped["duplicate"] += 1
        return None
    seen.add(key)
    return text


def corpus_chat_writer(max_files: int | None) -> Callable[[str | os.PathLike, Split, int, int], int]:
    """`write(path, split, max_samples, seed)`: MID_CHAT conversations from that split of the
    corpus (at most `max_files` files a split, as the target was built), as JSONL. The corpus
    is read once, on the first call."""
    loaded: list[CodeCorpus] = []

    def write(path: str | os.PathLike, split: Split, max_samples: int, seed: int) -> int:
        check_split(split)
        if not loaded:
            loaded.append(load_code_corpus(max_files))
        sources = loaded[0].train if split == "train" else loaded[0].heldout
        return write_samples_jsonl(path, chat_samples(sources, max_samples, seed, MID_CHAT))

    return write
