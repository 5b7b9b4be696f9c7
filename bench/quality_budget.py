"""The quality bench's budget: the a-priori estimate (SPEC 6's cost model), the per-run sample
count that fits the time left once calibration has measured a step and a tau measurement on
every worker at once, the checkpoints, and the LR schedule of a run."""

from __future__ import annotations

import math

from step_flops import model_flops

from dflash_dist.trainer.ds_config import schedule_span

H200_BF16_TFLOPS = 790.0  # dense bf16 matmul rate measured on the H200 (../shared/SPEC.md section 6)
ASSUMED_MFU = 0.25  # a small drafter's share of it (the estimate only; --samples auto measures)
# a tau measurement of a trained drafter against the untrained one calibration times: batched replay
# costs about the same (H100, 2026-12-05: 10.3-15.6 s a mark at tau 1.1-1.8 against 12.9-13.0 s in
# calibration; the 0.6 assumed before ran every wave ~21 s over and the budget stopped 3 runs)
EVAL_SHRINK = 1.0
MARGIN = 0.9  # of the fitting samples, for what the model leaves out (new shapes compiling, Python)


def estimate(drafter, batches: list) -> dict:
    """The a-priori rate: SPEC 6's cost model (step_flops.model_flops) over real micro-batches
    of the run (their anchors as drawn, packed rows' real tokens), per sample, at ASSUMED_MFU of the
    H200's bf16 rate."""
    flop = sum(model_flops(drafter, mb.input_ids.shape[1], mb.input_ids, mb.loss_mask, mb.anchors, mb.num_tokens)
               for mb in batches)  # fmt: skip
    samples = sum(len(mb.keys) for mb in batches)
    rate = H200_BF16_TFLOPS * ASSUMED_MFU
    per_sample = flop / max(1, samples)
    return {"tflop_per_sample": round(per_sample / 1e12, 4), "assumed_tflops": rate,
            "samples_per_s": round(rate * 1e12 / per_sample, 1) if per_sample else None}  # fmt: skip


def fit_workers(free: int, total: int, workers: int, reserve_gib: float = 6.0,
                min_share_gib: float = 6.0) -> tuple[int, float]:  # fmt: skip
    """How many of `workers` processes fit `free` bytes of a GPU of `total`, and each one's fraction
    of `total` (torch.cuda.set_per_process_memory_fraction): the free memory less `reserve_gib` a
    worker for what its allocator does not count (CUDA context, cuBLAS workspaces, compiled kernels:
    ~5 GiB a worker in an H200 OOM report), split evenly. A share under `min_share_gib` is too small
    to train in (an H100 at 7 workers gave each 2.4 GiB and every calibration died of OOM at 2.3 GiB
    allocated), so fewer workers run, each with a share that fits."""
    per_worker = (reserve_gib + min_share_gib) * 2**30
    fit = min(workers, int(free // per_worker))
    if fit < 1:
        need = per_worker / 2**30
        raise RuntimeError(f"not one worker fits the {free / 2**30:.1f} GiB left on the GPU after the shared "
                           f"data ({need:.0f} GiB a worker): run with --workers 0 (in this process)")  # fmt: skip
    return fit, (free - fit * reserve_gib * 2**30) / fit / total


def reserve_s(eval_s: float) -> float:
    """Seconds kept at the end for the last measurements of runs the budget stops, and the report."""
    return max(10.0, 1.5 * eval_s)


def fit_samples(
    cals: list[dict],
    left_s: float,
    runs: int,
    slots: int,
    checkpoints: int,
    products: int,
    max_samples: int,
    whole_steps: bool,
) -> tuple[int, dict]:
    """Samples per run so that `runs` runs, `slots` at a time, each with `checkpoints` tau
    measurements, plus `products` measurements of the product's exports, fit `left_s` seconds:
    from the calibration records (each worker's median step time under the same sharing, its
    samples per step, its compile time, one tau measurement of an untrained drafter). The slowest
    worker's figures count. Capped at `max_samples`, at least two steps; `whole_steps`: a multiple
    of the samples per step (count-based micro-batches)."""
    step_s = max(c["step_s"] for c in cals)
    per_step = sum(c["samples_per_step"] for c in cals) / len(cals)
    eval_s = EVAL_SHRINK * max(c["eval_s"] for c in cals)
    left = left_s - reserve_s(eval_s) - products * eval_s / slots
    per_run = left / math.ceil(runs / slots) - checkpoints * eval_s - max(c["warmup_s"] for c in cals)
    fitting = int(MARGIN * per_run / step_s * per_step)
    samples = max(int(2 * per_step), min(fitting, max_samples))
    if whole_steps:
        samples = max(int(per_step), samples // int(per_step) * int(per_step))
    info = {"step_s": step_s, "samples_per_step": per_step, "eval_s_estimate": eval_s, "reserve_s": reserve_s(eval_s),
            "per_run_s": per_run, "samples_fitting": fitting}  # fmt: skip
    return samples, info


def marks(samples: int, checkpoints: int) -> tuple[int, ...]:
    """Sample counts at which a run's tau is measured: `checkpoints` evenly spaced, the last at the end."""
    return tuple(sorted({max(1, round(samples * k / checkpoints)) for k in range(1, checkpoints + 1)}))


def product_marks(samples: int, product_samples: list[int | None]) -> tuple[int, tuple[int, ...]] | None:
    """(samples, marks) at the product run's own checkpoints: the largest product checkpoint that
    fits `samples` becomes the run's budget and every product checkpoint up to it a mark, so each
    bench point has a product export trained on exactly as many samples (the default variant at
    the run's seed replays the product's sample order: equal samples are equal steps). None when
    no product checkpoint with a known sample count fits."""
    known = sorted({n for n in product_samples if n})
    fitting = [n for n in known if n <= samples]
    if not fitting:
        return None
    return fitting[-1], tuple(fitting)


def run_marks(
    samples: int, checkpoints: int, aligned: tuple[int, tuple[int, ...]] | None, auto: bool
) -> tuple[int, tuple[int, ...], str]:
    """(samples, marks, where the marks come from) of every run: `checkpoints` evenly spaced marks,
    plus the product checkpoints that fit (`aligned`, product_marks). With an auto length the run
    ends at the largest product checkpoint that fits, so its last point has a product export
    trained on as many samples; a fixed length is kept. An evenly spaced mark within a quarter of
    the spacing of a product checkpoint is that checkpoint: the product's checkpoints are evenly
    spaced in steps, so they fall near the evenly spaced marks, and a second measurement a few
    samples away would cost a tau measurement (~13 s on an H100, the length of a short run's
    training) that fit_samples did not count (10986 samples in 2 marks: 5365 and 5493 besides 10986)."""
    if aligned is None:
        return samples, marks(samples, checkpoints), "evenly spaced"
    if auto:
        samples = aligned[0]
    near = samples / checkpoints / 4
    even = []
    for m in marks(samples, checkpoints):
        closest = min(aligned[1], key=lambda n: abs(n - m))
        even.append(closest if m != samples and abs(closest - m) <= near else m)
    both = tuple(sorted(set(even) | set(aligned[1])))
    return samples, both, "product checkpoints and evenly spaced" if auto else "evenly spaced and product checkpoints"


def schedule(cfg, samples: int, steps: int, mode: str, n_train: int) -> tuple[int, str]:
    """The LR schedule (length, unit) of a run that sees `samples` samples in `steps` optimizer
    steps: "run" spans the run itself (in samples when the trainer counts samples, else in steps:
    count-based micro-batches, or a packed run whose train.max_steps fixes the schedule in steps),
    "product" is the product run's own (ds_config.schedule_span over its data), cut where the
    bench stops."""
    if mode == "product":
        return schedule_span(cfg, cfg.train.world_size, cfg.data.max_train_samples or n_train)
    if cfg.schedule_unit() == "sample":
        return samples, "sample"
    return steps, "step"
