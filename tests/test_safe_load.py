"""Checkpoints never run code: every file DeepSpeed reads on resume is loaded weights-only
(dflash_dist/trainer/safe_load.py).

A real ZeRO checkpoint of the tiny trainer (1 rank in this process, gloo), then an attacker's
edit: a pickle whose `__reduce__` would create a file replaces one of the tag's files, its size
fixed in the completion marker. Resuming refuses, naming the file, and the payload never runs:
on the same-size path, on the elastic path that converts the tag (ds_to_universal), and on the
elastic path that loads an already converted universal copy. A truncated file is named too.
The allow-list is checked against
real ZeRO-1/2/3 checkpoints (types found by torch's own scan), which then resume weights-only.

Nor does anything else the package reads run code: a scan of dflash_dist/, data_pipeline/, bench/ and
launcher/ refuses torch.distributed's object collectives (they unpickle what peers send; the ranks
exchange JSON, trainer/collectives.py, tests/test_collectives.py), `torch.load` without
`weights_only=True`, the pickle family's loaders, and `allow_pickle=True`.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch

from dflash_dist.trainer import checkpoint, universal
from dflash_dist.trainer.safe_load import (
    DamagedCheckpointError,
    UnsafeCheckpointError,
    deepspeed_safe_globals,
    weights_only_loads,
)
from tests.conftest import REPO
from tests.helpers.tiny import make_cfg, write_shards

NUM = 8  # 4 shards of 2 samples; 1 rank trains 2 samples a step
STEPS = 2  # saved at step 2 of an LR schedule of TOTAL steps; a resume trains step 3
TOTAL = 3


class Payload:
    """What an attacker plants: unpickling it runs `touch <flag>`."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("safe_load") / "shards"
    write_shards(path, tiny["prov"], tiny["samples"][:NUM], done=True)
    return path


def cfg_for(out: Path, tiny, stage: int = 2, max_steps: int = STEPS):
    return make_cfg(out, tiny["target_dir"], world_size=1, zero_stage=stage, max_steps=max_steps,
                    checkpoint_every=STEPS)  # fmt: skip


def job_for(tiny, shards: Path, resume_from: Path | None = None, cfg=None):
    from dflash_dist.trainer.loop import TrainJob
    from dflash_dist.trainer.resume import decide
    from dflash_dist.trainer.state import STATE_VERSION

    decision = None if resume_from is None else decide(str(resume_from), cfg, shards, (TOTAL, "step"), STATE_VERSION)
    return TrainJob(str(tiny["target_dir"]), str(shards), tiny["prov"], tiny["drafter"], total_steps=TOTAL,
                    resume=decision)  # fmt: skip


def train(out: Path, tiny, shards: Path, stage: int = 2) -> Path:
    """A real checkpoint: 1 rank trains STEPS steps and saves step_STEPS."""
    from dflash_dist.trainer.loop import Trainer

    Trainer(cfg_for(out, tiny, stage), job_for(tiny, shards)).run()
    tag = out / "checkpoints" / checkpoint.tag_name(STEPS)
    assert checkpoint.read_marker(tag) is not None
    return tag


def forge_marker(tag: Path, name: str) -> None:
    """What an attacker who can write the run directory does after changing `tag/name`: fix its
    size and its checksum in the marker, so only the weights-only load stands in the way."""
    from data_pipeline.checksums import digest_file

    marker = json.loads((tag / checkpoint.MARKER).read_text())
    if name in marker["files"]:
        marker["files"][name] = (tag / name).stat().st_size
        sums = marker["checksums"]
        sums["files"][name] = digest_file(tag / name, sums["algorithm"])
        (tag / checkpoint.MARKER).write_text(json.dumps(marker))


def plant(tag: Path, name: str, flag: Path) -> Path:
    """Replace `tag/name` by a pickle payload; fix its size and checksum in the marker when the
    marker lists it."""
    path = tag / name
    torch.save({"optimizer_state_dict": Payload(flag)}, path)
    forge_marker(tag, name)
    return path


def pretend_saved_by_two_ranks(tag: Path) -> None:
    """The marker says 2 ranks saved it, so a 1-rank resume takes the elastic (universal) path."""
    marker = json.loads((tag / checkpoint.MARKER).read_text())
    marker["world_size"] = 2
    (tag / checkpoint.MARKER).write_text(json.dumps(marker))


def resume(out: Path, tiny, shards: Path, tag: Path, stage: int = 2):
    from dflash_dist.trainer.loop import Trainer

    cfg = cfg_for(out, tiny, stage, max_steps=TOTAL)
    return Trainer(cfg, job_for(tiny, shards, tag, cfg)).run()


def test_planted_pickle_in_a_checkpoint_is_refused_and_never_runs(tiny, shards, tmp_path, single_rank_gloo):
    out, flag = tmp_path / "run", tmp_path / "pwned"
    tag = train(out, tiny, shards)
    (optim,) = tag.glob("*optim_states.pt")
    plant(tag, optim.name, flag)
    assert checkpoint.read_marker(tag) is not None  # the marker vouches for the planted file
    with pytest.raises(UnsafeCheckpointError, match=rf"{optim}: refused to load: .*GLOBAL (posix|os).system"):
        resume(out, tiny, shards, tag)
    assert not flag.exists(), "the planted payload ran"


def test_planted_pickle_is_refused_by_the_universal_conversion(tiny, shards, tmp_path, single_rank_gloo):
    """Elastic resume: rank 0 converts the tag with DeepSpeed's ds_to_universal, which reads the
    planted file: refused, named, not run, and no converted copy is left."""
    out, flag = tmp_path / "run", tmp_path / "pwned"
    tag = train(out, tiny, shards)
    (model,) = tag.glob("*model_states.pt")
    plant(tag, model.name, flag)
    pretend_saved_by_two_ranks(tag)
    with pytest.raises(RuntimeError, match=rf"converting .* failed on rank 0: .*{model}: refused to load"):
        resume(out, tiny, shards, tag)
    assert not flag.exists(), "the planted payload ran"
    assert not universal.is_converted(tag)


def test_planted_pickle_in_a_universal_copy_is_refused_on_load(tiny, shards, tmp_path, single_rank_gloo):
    """Elastic resume from an already converted copy (`<tag>/universal/zero/<param>/*.pt`, read by
    DeepSpeed's universal loader): a planted file there is refused too."""
    out, flag = tmp_path / "run", tmp_path / "pwned"
    tag = train(out, tiny, shards)
    universal.convert(tag)
    fp32 = sorted(universal.universal_dir(tag).glob("zero/*/fp32.pt"))[0]
    torch.save(Payload(flag), fp32)
    copy = universal.universal_dir(tag)
    record = json.loads((copy / universal.UNIVERSAL_MARKER).read_text())  # the copy's own checksums: forged too
    from data_pipeline.checksums import digest_file

    name = str(fp32.relative_to(copy))
    record["checksums"]["files"][name] = digest_file(fp32, record["checksums"]["algorithm"])
    (copy / universal.UNIVERSAL_MARKER).write_text(json.dumps(record))
    pretend_saved_by_two_ranks(tag)
    with pytest.raises(UnsafeCheckpointError, match=rf"{fp32}: refused to load"):
        resume(out, tiny, shards, tag)
    assert not flag.exists(), "the planted payload ran"


def test_a_file_planted_beside_a_universal_copys_listed_files_is_not_loaded(tiny, shards, tmp_path, single_rank_gloo):
    """DeepSpeed's universal load globs the copy for `mp_rank_*_model_states.pt` and reads the first
    (sorted) for the trainer's client state (step, samples, data position, RNG) and the LR schedule.
    The tag's unlisted files are refused (checkpoint.verify_checksums), but the copy was exempted as
    having its own record, and reusing it compared only the files that record lists: a copy of the
    model states with the trainer's step set back to 1, planted as `mp_rank_0-_model_states.pt`, was
    loaded, and the resume trained steps 2 and 3 again (4 samples, not 2); an accidental copy (its
    mp_world_size 1) failed the resume in DeepSpeed's own assertion, naming no file. A copy holding a file its
    record does not list is converted again from the (verified) tag, which removes it."""
    out = tmp_path / "run"
    tag = train(out, tiny, shards)
    copy = universal.convert(tag)
    with weights_only_loads():
        states = torch.load(copy / "mp_rank_00_model_states.pt")
    assert [s["step"] for s in states["dflash"]["trainer"]] == [STEPS]
    for s in states["dflash"]["trainer"]:
        s["step"] = 1
    states["mp_world_size"] = 2  # DeepSpeed checks the files it globbed against this count (plain data)
    planted = copy / "mp_rank_0-_model_states.pt"  # sorts before mp_rank_00_...
    torch.save(states, planted)
    pretend_saved_by_two_ranks(tag)
    result = resume(out, tiny, shards, tag)
    assert (result.steps, result.samples_consumed) == (TOTAL, 2)
    assert not planted.exists() and universal.is_converted(tag)


def test_truncated_file_with_a_matching_marker_is_named(tiny, shards, tmp_path, single_rank_gloo):
    """A checkpoint file cut short after the marker was fixed to its size (so the marker check
    passes): the load fails naming the file, not with the zip reader's bare message."""
    out = tmp_path / "run"
    tag = train(out, tiny, shards)
    (optim,) = tag.glob("*optim_states.pt")
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    forge_marker(tag, optim.name)
    with pytest.raises(DamagedCheckpointError, match=rf"{optim}: cannot be read .*damaged \(truncated\?\)"):
        resume(out, tiny, shards, tag)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_allow_list_covers_what_deepspeed_saves_and_checkpoints_resume(tiny, shards, tmp_path, single_rank_gloo,
                                                                       stage):  # fmt: skip
    """Torch's scan of real checkpoints (and of their universal copies) finds no type outside
    the allow-list, and the checkpoint resumes weights-only at the same world size."""
    out = tmp_path / "run"
    tag = train(out, tiny, shards, stage)
    if stage in checkpoint.ELASTIC_STAGES:
        universal.convert(tag)
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in deepspeed_safe_globals()}
    files = sorted(tag.rglob("*.pt"))
    assert files
    for f in files:
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(f))
        assert unsafe <= allowed, (f, unsafe - allowed)
        with weights_only_loads():
            torch.load(f, map_location="cpu")
    result = resume(out, tiny, shards, tag, stage)
    assert result.resumed_from == str(tag) and result.steps == TOTAL


# ---------------------------------------------------------------- nothing else the package reads runs code
SCANNED = ("dflash_dist", "data_pipeline", "launcher", "bench")  # bench: scripts users run on their runs
# torch.distributed's object collectives pickle on the sender and unpickle what arrives from peers
OBJECT_COLLECTIVE = re.compile(r"^i?(all_gather|gather|broadcast|scatter|send|recv)_object(_list)?$")
PICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "jsonpickle"}
PICKLE_LOADERS = {"load", "loads", "Unpickler", "open"}  # open: shelve


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _keyword_false(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is False for k in call.keywords)


def _keyword_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def code_from_data(source: str, where: str) -> list[str]:
    """Calls in `source` that can run code carried by bytes they read (`where:line: what`)."""
    tree = ast.parse(source, where)
    aliases: dict[str, str] = {}  # local name -> module, from `import x as y`
    imported: dict[str, str] = {}  # local name -> name, from `from m import x as y`
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({(a.asname or a.name).split(".")[0]: a.name.split(".")[0] for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            imported.update({a.asname or a.name: a.name for a in node.names})
            for a in node.names:
                if (top in PICKLERS and a.name in PICKLE_LOADERS) or (node.module == "torch" and a.name == "load") or (
                    OBJECT_COLLECTIVE.match(a.name)
                ):  # fmt: skip
                    found.append(f"{where}:{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        first, last = name.split(".")[0], name.rpartition(".")[2]
        head = aliases.get(first, first)
        why = None
        if OBJECT_COLLECTIVE.match(last):
            why = "unpickles what peer ranks send: exchange JSON (dflash_dist/trainer/collectives.py)"
        elif name in ("torch.load", "torch.serialization.load") and not _keyword_true(node, "weights_only"):
            why = "unpickles the file: pass weights_only=True (or load through safe_load.weights_only_loads)"
        elif head in PICKLERS and last in PICKLE_LOADERS and "." in name:
            own = bool(node.args) and isinstance(node.args[0], ast.Call) and _dotted(node.args[0].func).endswith(
                ".dumps")  # fmt: skip
            why = None if own else "unpickles what it reads: read JSON, npy (no object dtype) or safetensors"
        elif last == "read_pickle":
            why = "unpickles the file"
        elif last in ("from_pretrained", "from_config") and imported.get(first, first).startswith("Auto") and not (
            _keyword_false(node, "trust_remote_code") or any(k.arg is None for k in node.keywords)
        ):  # fmt: skip
            why = "may run the model directory's Python files (auto_map): pass trust_remote_code=False (NO_REMOTE_CODE)"
        if _keyword_true(node, "allow_pickle"):
            why = "allow_pickle=True unpickles object arrays"
        if why is not None:
            found.append(f"{where}:{node.lineno}: {name}(...): {why}")
    return found


def test_the_package_neither_unpickles_nor_gathers_objects():
    """No module of the package can be made to run code by what it reads: files, peers' messages."""
    found = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            found += code_from_data(path.read_text(), str(path.relative_to(REPO)))
    assert not found, "calls that run code carried by data:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.all_gather_object(out, state, group=g)",
        "from torch import distributed\ndistributed.broadcast_object_list(error, src=0)",
        "from torch.distributed import all_gather_object",
        "import torch.distributed as d\nd.scatter_object_list(a, b)\n",
        "import torch\ntorch.load(path)",
        "import torch\ntorch.load(path, map_location='cpu', weights_only=False)",
        "import pickle as p\np.loads(blob)",
        "import pickle\npickle.Unpickler(f).load()",
        "from pickle import loads",
        "import cloudpickle\ncloudpickle.load(f)",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import pandas as pd\npd.read_pickle(path)",
        "from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained(d)",
        "from transformers import AutoModelForCausalLM as M\nM.from_pretrained(d, dtype=t)",
        "from transformers import AutoConfig\nAutoConfig.from_pretrained(d, trust_remote_code=True)",
    ],
)
def test_the_scan_finds_each_way_back_in(source):
    assert code_from_data(source, "m.py"), source


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(path, map_location='cpu', weights_only=True)",
        "import pickle\npickle.loads(pickle.dumps(error))",  # its own object, nothing read
        "import pickle\nexcept_types = (pickle.UnpicklingError,)",
        "import json\njson.loads(text)",
        "import torch.distributed as dist\ndist.all_gather(parts, buf, group=g)",
        "import numpy as np\nnp.load(f)",
        "from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained(d, trust_remote_code=False)",
        "AutoModelForCausalLM.from_config(c, **NO_REMOTE_CODE)",
        "PreTrainedTokenizerFast.from_pretrained(d)",  # a concrete class: no auto_map is consulted
    ],
)
def test_the_scan_lets_data_only_reads_pass(source):
    assert not code_from_data(source, "m.py"), source
