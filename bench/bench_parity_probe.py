"""Parity probe at the Qwen3.5-27B shape (random bf16 weights, the layers our config captures):
per captured layer, the relative L2 difference of the features and the argmax agreement

  1. fla vs torch reference: the same tokens through fla's Gated DeltaNet kernels and through
     transformers' torch reference path (capture_features both times); on CUDA also the fused
     capture path (capture.kernels=fused, kernel path fla_fused) against eager fla and torch;
  2. full vs chunked: one forward over all tokens vs a prefill of --prefill tokens followed by the
     rest fed with the model's cache in blocks of --block tokens and then --singles single tokens,
     as a live decoder (the evaluator's verify passes) sees them; for each kernel path.

    python bench/bench_parity_probe.py                       # 2 x 2048 tokens, prefill 1536
    python bench/bench_parity_probe.py --tiny --device cpu   # smoke run (torch path only)

rel L2 = ||a - b|| / ||b|| over the positions compared (float64 norms); b is the torch reference
in (1) and the full forward in (2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capture import build_random_target, target_config  # noqa: E402

from data_pipeline.provenance import installed_versions  # noqa: E402
from dflash_dist.config import Config  # noqa: E402
from dflash_dist.model.capture import LayerTap, capture_features, chunked_argmax, gdn_kernel_path  # noqa: E402
from dflash_dist.target.loading import layer_ids_for  # noqa: E402

_GDN_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


@contextlib.contextmanager
def torch_reference_gdn():
    """Route Gated DeltaNet through transformers' torch reference functions (the ones its
    decorator wraps) instead of what it resolved at import (fla's kernels when importable)."""
    saved = {name: getattr(modeling_qwen3_5, name) for name in _GDN_FUNCS}
    try:
        for name, fn in saved.items():
            while hasattr(fn, "__wrapped__"):
                fn = fn.__wrapped__
            setattr(modeling_qwen3_5, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(modeling_qwen3_5, name, fn)


@torch.no_grad()
def chunked_capture(model, ids: torch.Tensor, layer_ids: list[int], prefill: int, block: int, singles: int):
    """Features [b, T, k*H] and argmax [b, T] from a prefill + cached continuation."""
    base = model.model
    cache = DynamicCache(config=model.config)
    feats, hidden, pos, t = [], [], 0, ids.shape[1]
    with LayerTap(model, layer_ids) as tap:
        while pos < t:
            n = prefill if pos == 0 else (1 if pos >= t - singles else min(block, t - singles - pos))
            out = base(input_ids=ids[:, pos : pos + n], cache=cache, use_cache=True)
            feats.append(tap.concat())
            hidden.append(out.last_hidden_state)
            pos += n
    return torch.cat(feats, 1), chunked_argmax(torch.cat(hidden, 1), model.get_output_embeddings())


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def per_layer(fa, fb, aa, ab, layer_ids, layer_types, h: int, sl: slice) -> list[dict]:
    rows = []
    for j, lid in enumerate(layer_ids):
        cols = slice(j * h, (j + 1) * h)
        rows.append({"layer": lid, "type": layer_types[lid], "rel_l2": rel_l2(fa[:, sl, cols], fb[:, sl, cols])})
    rows.append({"layer": "argmax", "agreement": float((aa[:, sl] == ab[:, sl]).double().mean())})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=1536)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--singles", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not 0 < a.prefill < a.len or a.singles >= a.len - a.prefill:
        raise SystemExit(f"need 0 < --prefill < --len and --singles < --len - --prefill, got {a}")

    t0 = time.perf_counter()
    model = build_random_target(target_config(a.tiny), a.device, torch.bfloat16)
    cfg = model.config
    layer_ids = layer_ids_for(Config(), cfg.num_hidden_layers)
    h = cfg.hidden_size
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (a.seqs, a.len), generator=g).to(a.device)
    print(
        f"target built in {time.perf_counter() - t0:.1f} s; layers {layer_ids}; {a.seqs} x {a.len} tokens; "
        f"torch {torch.__version__}, {installed_versions()}",
        flush=True,
    )

    paths = {}
    fast = capture_features(model, ids, layer_ids)
    paths[fast.kernel_path] = fast
    with torch_reference_gdn():
        assert gdn_kernel_path(model) == "torch"
        ref = capture_features(model, ids, layer_ids, allow_torch_gdn_on_cuda=True)
        paths["torch"] = ref
        ref_chunked = chunked_capture(model, ids, layer_ids, a.prefill, a.block, a.singles)
    report: dict = {
        "layer_ids": layer_ids,
        "seqs": a.seqs,
        "len": a.len,
        "prefill": a.prefill,
        "block": a.block,
        "singles": a.singles,
        "kernel_path": fast.kernel_path,
        "torch": torch.__version__,
        **installed_versions(),
    }
    everything = slice(0, a.len)
    report["fast_vs_torch"] = per_layer(
        fast.features, ref.features, fast.target_argmax, ref.target_argmax, layer_ids, cfg.layer_types, h, everything
    )
    if fast.kernel_path == "fla":  # capture.kernels=fused (kernel path fla_fused) against eager fla and torch
        from dflash_dist.capture.fused_target import fuse_target, unfuse_target

        torch_conv = modeling_qwen3_5.causal_conv1d_fn
        fuse_target(model)
        try:
            fused = capture_features(model, ids, layer_ids)
        finally:
            unfuse_target(model, torch_conv)
        for name, other in (("fla_fused_vs_fla", fast), ("fla_fused_vs_torch", ref)):
            report[name] = per_layer(fused.features, other.features, fused.target_argmax, other.target_argmax,
                                     layer_ids, cfg.layer_types, h, everything)
    chunked = {"torch": ref_chunked}
    if fast.kernel_path != "torch":
        chunked[fast.kernel_path] = chunked_capture(model, ids, layer_ids, a.prefill, a.block, a.singles)
    for path, (cf, ca) in chunked.items():
        full = paths[path]
        for part, sl in (("prefill", slice(0, a.prefill)), ("continuation", slice(a.prefill, a.len))):
            report[f"chunked_vs_full/{path}/{part}"] = per_layer(
                cf, full.features, ca, full.target_argmax, layer_ids, cfg.layer_types, h, sl
            )

    print(f"\n{'comparison':<40} " + " ".join(f"L{i:<8}" for i in layer_ids) + " argmax agree")
    for name, rows in report.items():
        if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
            continue
        label = f"{fast.kernel_path} vs torch" if name == "fast_vs_torch" else name
        cells = " ".join(f"{r['rel_l2']:<9.2e}" for r in rows[:-1])
        print(f"{label:<40} {cells} {100 * rows[-1]['agreement']:6.2f}%")
    print("layer types: " + ", ".join(f"L{i}={cfg.layer_types[i]}" for i in layer_ids))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{a.json}.tmp-{os.getpid()}"
        Path(tmp).write_text(json.dumps(report, indent=1))
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
