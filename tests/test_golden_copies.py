"""The in-repository golden copies (tests/golden*) equal their source ../shared/golden* byte for
byte when the source is there; a clone without ../shared tests against the copies alone."""

from __future__ import annotations

import pytest

from tests.conftest import GOLDEN_SETS, REPO


@pytest.mark.parametrize("name", GOLDEN_SETS)
def test_copy_equals_shared_source(name):
    copy, source = REPO / "tests" / name, REPO.parent / "shared" / name
    copied = sorted(p.name for p in copy.iterdir() if p.is_file())
    assert "drafter_config.json" in copied and "tolerances.json" in copied
    if not source.is_dir():  # a plain clone: nothing to compare against, the copies are the data
        return
    data = sorted(p.name for p in source.iterdir() if p.is_file() and p.suffix != ".md")
    assert copied == data, f"tests/{name} holds {copied}, ../shared/{name} {data}"
    for f in data:
        assert (copy / f).read_bytes() == (source / f).read_bytes(), f"tests/{name}/{f} differs from ../shared/{name}"
