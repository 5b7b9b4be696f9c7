"""The layers of the code base (docs/ARCHITECTURE.md): every import, at module level or inside a
function, points down or sideways, never up; and no module grows past the size the style allows.
In tests/, no module imports a test module: shared helpers live in tests/helpers/, fixtures in
tests/conftest.py.

    config  <  data_pipeline (its records at the bottom), model  <  target  <  trainer, evaluator, capture
      <  actors  <  orchestration  <  launcher, tools (and the `dflash_dist.parity` entry)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

# package prefix -> layer; the longest matching prefix wins
LAYERS = {
    "dflash_dist.config": 0,
    "dflash_dist.logging_setup": 0,
    "dflash_dist.compile_cache": 0,
    "dflash_dist.strict_compile": 0,
    "dflash_dist.node_address": 0,
    "data_pipeline": 1,
    "dflash_dist.model": 1,
    "dflash_dist.target": 2,
    "dflash_dist.trainer": 3,
    "dflash_dist.evaluator": 3,
    "dflash_dist.capture": 3,
    "dflash_dist.actors": 4,
    "dflash_dist.orchestration": 5,
    "dflash_dist.tools": 6,
    "dflash_dist.parity": 6,
    "launcher": 6,
}
MAX_LINES = 600


def layer_of(module: str) -> tuple[str, int] | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return best


def project_modules() -> dict[str, Path]:
    out = {}
    for top in ("dflash_dist", "data_pipeline", "launcher"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")
                if path.name == "__init__.py" and node.level > 1:
                    base = module.split(".")[: -(node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # `from dflash_dist import pipeline` names a submodule
            found += [(node.lineno, f"{name}.{a.name}") for a in node.names if layer_of(f"{name}.{a.name}")]
    return found


def test_layer_table_covers_every_module():
    missing = [m for m in project_modules() if m not in ("dflash_dist",) and layer_of(m) is None]
    assert not missing, f"modules outside the layer table (add them to LAYERS and ARCHITECTURE.md): {missing}"


def test_imports_point_down_only():
    upward = []
    for module, path in project_modules().items():
        own = layer_of(module)
        if own is None:
            continue
        for line, name in imports_of(path, module):
            other = layer_of(name)
            if other is not None and other[1] > own[1]:
                upward.append(f"{path.relative_to(REPO)}:{line}: {module} (layer {own[1]}) imports {name} "
                              f"(layer {other[1]})")
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def test_model_code_is_plain_torch():
    """STYLE 6: the drafter, loss, capture and DDTree build without Ray, DeepSpeed or torch.distributed."""
    banned = ("ray", "deepspeed", "torch.distributed")
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for module, path in project_modules().items()
        if module.startswith("dflash_dist.model")
        for line, name in imports_of(path, module)
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]
    assert not bad, bad


@pytest.mark.parametrize("top", ["dflash_dist", "data_pipeline", "launcher", "bench"])
def test_no_module_over_the_size_limit(top):
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in (REPO / top).rglob("*.py")}
    long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_every_layer_entry_names_a_module_that_exists():
    """A table entry naming no module would hide a typo (or a module that moved) from the check."""
    modules = project_modules()
    stale = [prefix for prefix in LAYERS if not any(m == prefix or m.startswith(prefix + ".") for m in modules)]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check itself: a model module importing the orchestration layer is caught."""
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from dflash_dist.orchestration.pipeline import run_pipeline\n")
    names = [n for _, n in imports_of(fake, "dflash_dist.model.m")]
    assert layer_of(names[0])[1] > layer_of("dflash_dist.model.m")[1]


# ---------------------------------------------------------------------------- tests/ itself
TEST_MODULE = re.compile(r"tests\.test_\w+(\..*)?")


def refs_to_test_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """Where the module `module` (a file under tests/) imports a test module, at module level or
    inside a function (`from tests.test_x import f`, `from tests import test_x`, `import
    tests.test_x`, relative forms too), or names one in a string (`python -m tests.test_x`,
    import_module). Its own name is allowed: the `python -m` entry of the rank processes it starts."""
    package = module.split(".")[: -1 if path.name != "__init__.py" else None]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value != module:
            names = [node.value]
        found += [(node.lineno, n) for n in names if TEST_MODULE.fullmatch(n)]
    return found


def modules_in_tests() -> dict[str, Path]:
    return {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in sorted((REPO / "tests").rglob("*.py"))}


def test_no_test_module_imports_another():
    """A test module is not a fixture library: what several modules share lives in tests/helpers/
    (fixtures in tests/conftest.py), so a module runs, moves or shrinks without breaking another."""
    bad = [f"{path.relative_to(REPO)}:{line}: {name}" for module, path in modules_in_tests().items()
           for line, name in refs_to_test_modules(path, module)]  # fmt: skip
    assert not bad, "test modules used by other modules (move the shared parts to tests/helpers/):\n" + "\n".join(bad)


def test_the_checker_sees_a_test_module_import(tmp_path):
    """The check itself: every way of reaching another test module is caught, a module's own
    `python -m` entry is not."""
    fake = tmp_path / "test_a.py"
    fake.write_text(
        "from tests.test_b import make_cfg\n"
        "from tests import test_c\n"
        "import tests.test_d\n"
        "from .test_e import x\n"
        "from tests.helpers.tiny import make_cfg\n"
        "def f():\n"
        "    from tests.test_f import y\n"
        "    run(['python', '-m', 'tests.test_a'])\n"
        "    run(['python', '-m', 'tests.test_g'])\n"
    )
    names = [n for _, n in refs_to_test_modules(fake, f"tests.{fake.stem}")]
    assert names == [f"tests.test_{x}" for x in ("b", "b.make_cfg", "c", "d", "e", "e.x", "f", "f.y", "g")]
