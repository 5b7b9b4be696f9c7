"""DFlash training forward and loss (SPEC 3; numerically SpecForge's OnlineDFlashModel).

Per sequence, up to `num_anchors` anchors among supervised (loss-masked) positions; each anchor
opens a block [anchor token, MASK x (B-1)]; all blocks of the batch run in one drafter forward
under the block mask; slot s of block j is labelled with the token at a_j + s and weighted by
exp(-(s-1)/gamma). No noise schedule: every non-anchor slot is MASK.

Recipe options (issue 13; defaults = the behaviour the pinned loss curve was recorded with):
- anchor rule "mask" (loss_mask[a]) or "mask_next" (loss_mask[a] and loss_mask[a+1]);
- position weighting "decay" (exp(-(s-1)/gamma)) or "dpace" (D-PACE, weights from the draft's own
  detached confidence, computed after the forward);
- normalisation: sum(w*CE) / (sum(w) + 1e-6) over the micro-batch, or sum(w*CE) / D with D given
  by the caller (the normalising weights summed over the optimizer step and all ranks, from
  `loss_weights` before the forward).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_dist.model.attention import block_mask_dense, layer_masks
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.vocab_loss import lm_head_cross_entropy

LABEL_SOURCES = ("data", "target")
ANCHOR_RULES = ("mask", "mask_next")
POSITION_WEIGHTINGS = ("decay", "dpace")
# D-PACE smoothing: q~ = (1 - alpha) q + alpha. 0.5 is the default of SpecForge (--dpace-alpha),
# NVIDIA Model-Optimizer (dflash_dpace_alpha, "stable in [0.3, 0.7]") and speculators' recipe.
DPACE_ALPHA = 0.5


@dataclass(frozen=True)
class Anchors:
    positions: torch.Tensor  # [b, N] int64, sorted; 0 where invalid
    keep: torch.Tensor  # [b, N] bool
    # packed rows (several documents per row): each anchor's document [start, end) in the row;
    # its block sees context only from `starts` and is labelled only before `ends`. None: the
    # row is one document.
    starts: torch.Tensor | None = None  # [b, N] int64
    ends: torch.Tensor | None = None  # [b, N] int64


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    accuracy: torch.Tensor  # scalar: argmax == label over supervised slots (no decay)
    slot_correct: torch.Tensor  # [B] correct counts per slot (slot 0 always 0)
    slot_count: torch.Tensor  # [B] supervised counts per slot
    num_blocks: torch.Tensor  # scalar int64: blocks with keep (on the anchors' device, never read here)
    logits: torch.Tensor | None = None  # [b, N*B, V] only when asked (parity / tests)
    extras: dict | None = None
    # per sample of the batch (no grad; diagnostics): its weighted CE / its weight, and its
    # supervised slots' correct and total counts
    sample_loss: torch.Tensor | None = None  # [b]
    sample_correct: torch.Tensor | None = None  # [b]
    sample_count: torch.Tensor | None = None  # [b]
    # this micro-batch's sum of the normalising weights (`loss_weights`), detached: what a caller
    # sums over the step and all ranks to get the step_slots denominator
    weight_sum: torch.Tensor | None = None
    # on the device, never read here (no host sync per micro-batch): the loss is finite, or there
    # was nothing to supervise. The trainer checks the logged loss at log steps.
    finite: torch.Tensor | None = None

    @property
    def slot_accuracy(self) -> torch.Tensor:
        return self.slot_correct / self.slot_count.clamp(min=1)


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None, rule: str = "mask"
) -> Anchors:
    """Up to `num_anchors` distinct anchors per row among positions a with a + 1 < S (so slot 1
    has a label) and, by `rule`: "mask" loss_mask[a]; "mask_next" loss_mask[a] and loss_mask[a+1].

    "mask_next" is the candidate rule of SpecForge's DSpark sampler (`_build_anchor_candidate_mask`:
    "position p is a candidate when p and p+1 are both supervised") and of TorchSpec's DFlash
    model (`(loss_mask[:, :n] > 0.5) & (loss_mask[:, 1:n+1] > 0.5)`): under "mask" the last
    supervised token of a turn is an anchor whose block supervises nothing (slot 1 falls on the
    next, unsupervised turn). Unlike SpecForge we keep anchors closer than B to the end (their
    blocks are cut, as today). Fresh per call: the caller seeds the generator per
    (seed, epoch, sample) so every epoch sees new anchors and a resume replays them exactly."""
    if rule not in ANCHOR_RULES:
        raise ValueError(f"train.anchor_rule={rule!r}; expected one of {ANCHOR_RULES}")
    b, s = loss_mask.shape
    cand = loss_mask.bool().clone()
    cand[:, s - 1 :] = False
    if rule == "mask_next":
        cand[:, : s - 1] &= loss_mask[:, 1:].bool()
    counts = cand.sum(1)
    n = int(min(num_anchors, int(counts.max()) if b else 0))
    positions = torch.zeros(b, max(n, 1), dtype=torch.long)
    keep = torch.zeros(b, max(n, 1), dtype=torch.bool)
    for i in range(b):
        idx = cand[i].nonzero().flatten().cpu()
        take = min(n, idx.numel())
        if take == 0:
            continue
        pick = idx[torch.randperm(idx.numel(), generator=generator)[:take]].sort().values
        positions[i, :take] = pick
        keep[i, :take] = True
    return Anchors(positions.to(loss_mask.device), keep.to(loss_mask.device))


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_s = exp(-max(s-1, 0)/gamma) for s = 0..B-1 (slot 0 is masked anyway)."""
    s = torch.arange(block_size, dtype=torch.float32)
    return torch.exp(-(s - 1).clamp(min=0) / gamma)


def dpace_weights(prob: torch.Tensor, binary: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """D-PACE position weights [b, N, B] (arXiv 2605.18810, Eq. 7-8), detached.

    prob: the draft's probability of the label at each slot, exp(-CE). q~_i = (1-alpha) q_i + alpha
    (Eq. 7); w_j = sum_{m >= j, m supervised} prod_{i <= m} q~_i (Eq. 8): slot j is worth the
    expected accepted length it still controls. Unsupervised slots (slot 0, cut or masked ones)
    are no-ops in the products and absent from the sums, as in SpecForge's
    `OnlineDFlashModel._dpace_weight` (loss_type "dpace"); Model-Optimizer PR #1724 and
    speculators PR #980 use the same formula with alpha 0.5. The caller multiplies by `binary`.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace alpha must be in [0, 1], got {alpha}")
    with torch.no_grad():
        prob, binary = prob.detach().float(), binary.detach().float()
        smooth = torch.where(binary > 0, (1.0 - alpha) * prob + alpha, torch.ones_like(prob))
        prefix = torch.cumprod(smooth, dim=-1)
        return torch.flip(torch.cumsum(torch.flip(prefix * binary, dims=[-1]), dim=-1), dims=[-1])


def loss_weights(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: Anchors, block_size: int, gamma: float,
    position_weighting: str = "decay",
) -> torch.Tensor:
    """The normalising weights w [b, N, B], known before the forward: binary * exp(-(s-1)/gamma)
    under "decay" (the loss's own weights), binary under "dpace" (each supervised slot counts 1;
    D-PACE's own weights need the forward's confidences and only enter the numerator).

    sum(w) over a micro-batch is `LossOutput.weight_sum`; summed over the optimizer step and all
    ranks it is the `loss_denominator` of the step_slots normalisation."""
    _, binary = label_targets(input_ids, loss_mask, anchors, block_size)
    return _normalising_weights(binary, block_size, gamma, position_weighting)


def _normalising_weights(binary: torch.Tensor, block_size: int, gamma: float, position_weighting: str) -> torch.Tensor:
    """`loss_weights` from `label_targets`' binary weights (dflash_loss has them already)."""
    if position_weighting not in POSITION_WEIGHTINGS:
        raise ValueError(f"train.position_weighting={position_weighting!r}; expected one of {POSITION_WEIGHTINGS}")
    if position_weighting == "dpace":
        return binary
    return binary * _decay_weights_on(block_size, gamma, binary.device)


@functools.lru_cache(maxsize=16)
def _decay_weights_on(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """decay_weights as computed on the host, copied to `device` once: the copy of a host tensor to a GPU
    waits for the queued kernels, and it ran in every micro-batch's forward. Read only (never written)."""
    return decay_weights(block_size, gamma).to(device)


def supervised_rows(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: Anchors, block_size: int,
                    ) -> torch.Tensor:  # fmt: skip
    """The slots with a label weight (`label_targets`' binary > 0) as ascending flat indices into
    [b, N, B]: the rows `dflash_loss` sends through the lm_head. Their number sizes the chunked head,
    so finding them from device tensors is a host read (a nonzero) that waits for every queued
    kernel; on the host batch, before it moves to the device, it waits for nothing (the trainer
    passes them as `dflash_loss(rows=...)`)."""
    _, binary = label_targets(input_ids, loss_mask, anchors, block_size)
    return binary.reshape(-1).nonzero().squeeze(1)


def block_inputs(input_ids: torch.Tensor, anchors: Anchors, block_size: int, mask_token_id: int):
    """Block token ids and positions [b, N*B]: [input_ids[a_j], MASK...] at a_j .. a_j+B-1;
    invalid blocks are all MASK."""
    b, n = anchors.positions.shape
    offs = torch.arange(block_size, device=input_ids.device)
    pos = anchors.positions[:, :, None] + offs  # [b, N, B]
    ids = torch.full((b, n, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    first = torch.gather(input_ids, 1, anchors.positions)
    ids[:, :, 0] = torch.where(anchors.keep, first, torch.full_like(first, mask_token_id))
    return ids.view(b, n * block_size), pos.view(b, n * block_size)


def label_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: Anchors, block_size: int,
    target_argmax: torch.Tensor | None = None, label_source: str = "data",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [b, N, B] and binary weights [b, N, B].

    label_source "data": the sequence's own token at a_j + s (responses regenerated by the target);
    "target": the target's argmax at a_j + s - 1, i.e. its greedy prediction of that token.
    Weight = keep * (a_j + s < S, or < its document end in a packed row) * (s > 0) * loss_mask[a_j + s].
    """
    if label_source not in LABEL_SOURCES:
        raise ValueError(f"label_source={label_source!r}; expected one of {LABEL_SOURCES}")
    s_len = input_ids.shape[1]
    pos = anchors.positions[:, :, None] + torch.arange(block_size, device=input_ids.device)
    in_bounds = pos < (s_len if anchors.ends is None else anchors.ends[:, :, None])  # packed: its own document
    idx = pos.clamp(max=s_len - 1)
    b, n, _ = idx.shape
    flat = idx.view(b, -1)
    if label_source == "data":
        labels = torch.gather(input_ids, 1, flat).view(b, n, block_size)
    else:
        if target_argmax is None:
            raise ValueError("label_source='target' needs the target argmax captured with the features")
        labels = torch.gather(target_argmax, 1, (flat - 1).clamp(min=0)).view(b, n, block_size)
    lm = torch.gather(loss_mask.float(), 1, flat).view(b, n, block_size)
    slot = torch.arange(block_size, device=input_ids.device)
    binary = anchors.keep[:, :, None] & in_bounds & (slot > 0)
    return labels, binary.float() * lm


def dflash_loss(
    drafter: DFlashDrafter,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: Anchors,
    *,
    target_argmax: torch.Tensor | None = None,
    label_source: str = "data",
    gamma: float | None = None,
    attention: str = "auto",
    return_logits: bool = False,
    vocab_chunk_rows: int | None = None,
    position_weighting: str = "decay",
    dpace_alpha: float = DPACE_ALPHA,
    loss_denominator: torch.Tensor | None = None,
    block_mask: str = "direct",
    rows: torch.Tensor | None = None,
) -> LossOutput:
    """One training forward over all blocks of the batch; loss = sum(w*CE) / (sum(w) + 1e-6), or
    sum(w*CE) / loss_denominator when given (step_slots: the caller sums `loss_weights` over the
    whole optimizer step and all ranks; the micro-batch losses of a step then add up, over
    micro-batches and ranks, to the step's loss, so an engine that averages gradients over
    micro-batches and ranks must get each loss scaled by accumulation steps x world size).

    position_weighting "decay": w = binary * exp(-(s-1)/gamma); "dpace": w = binary * D-PACE
    weights from this forward's detached confidences (`dpace_weights`), normalised by the
    supervised slot count (`loss_weights`). On the chunked vocabulary path the head runs once: the
    weights are formed from all rows' CE after the chunks and then scale the rows' gradients
    (vocab_loss.ChunkedLMHeadCE): for the same CE, bitwise as if they had been known before.

    attention: "flex" (sparse BlockMask), "dense" (bool mask through sdpa) or "auto" (flex on
    CUDA, dense on CPU). The loss over the vocabulary runs through the frozen lm_head in chunks of
    `vocab_chunk_rows` supervised slots (default: vocab_loss.CHUNK_BYTES of logits, 2 GiB, balanced) and skips
    unsupervised slots; return_logits=True (parity, tests) materialises all logits instead.
    block_mask: how flex's BlockMask is built, "direct" or "create" (attention.block_mask_flex).
    rows: `supervised_rows` of these inputs, found on the host (on the compute device); None: found
    here with a nonzero, the forward's one host sync (it waits for every queued kernel). The caller
    vouches that they are these inputs' rows: they are not checked (that would be the read again).
    The drafter gets the rows and returns only their hidden states; nothing here reads another row of
    its output, which is what makes its last-layer row cut exact (drafter.py; return_logits: every row).
    """
    cfg = drafter.config
    bsz, s_len = input_ids.shape
    blk = cfg.block_size
    gamma = cfg.loss_decay_gamma if gamma is None else gamma
    if attention == "auto":
        attention = "flex" if input_ids.is_cuda else "dense"

    # labels, weights and the supervised rows first: without `rows` their nonzero is the forward's
    # one host sync, and here it waits for no queued drafter work (but for the previous step's)
    n = anchors.positions.shape[1]
    labels, binary = label_targets(input_ids, loss_mask, anchors, blk, target_argmax, label_source)
    norm_weights = _normalising_weights(binary, blk, gamma, position_weighting)  # loss_weights, from this binary
    weights = norm_weights  # decay: the loss weights are the normalising ones
    denom = norm_weights.sum() + 1e-6 if loss_denominator is None else loss_denominator
    if return_logits:
        rows = None
    elif rows is None:
        rows = binary.reshape(-1).nonzero().squeeze(1)
    num_blocks = anchors.keep.sum()
    kernels = getattr(drafter, "kernels", "torch")  # fused.py's CE kernel when the drafter uses fast kernels

    context = drafter.fuse_context(features)
    ids, pos = block_inputs(input_ids, anchors, blk, cfg.mask_token_id)
    ctx_pos = torch.arange(s_len, device=input_ids.device).expand(bsz, s_len)
    mask = layer_masks(attention, anchors.positions, anchors.keep, s_len, blk, cfg.layer_types, cfg.sliding_window,
                       anchors.starts, block_mask)
    # ids are block_inputs' [anchor, MASK x (B-1)] blocks (the drafter's layer-0 cut relies on it); with `rows`
    # (all but return_logits) the drafter returns the supervised rows' hidden states only, [R, H]: nothing
    # here reads another row of its output (drafter.py's last-layer cut)
    hidden = drafter(ids, pos, context, ctx_pos, mask, anchor_blocks=True, rows=rows)
    if return_logits:
        logits = drafter.lm_head(hidden).float()  # [b, N*B, V]
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="none")
        ce = ce.view(bsz, n, blk)
        if position_weighting == "dpace":
            weights = binary * dpace_weights(torch.exp(-ce.detach()), binary, dpace_alpha)
        loss = (weights * ce).sum() / denom
        sample_wce = (weights * ce.detach()).sum((1, 2))
        argmax = logits.argmax(-1).view(bsz, n, blk)
    else:
        # only supervised slots reach the vocabulary (slot 0, invalid blocks and slots past the
        # sequence carry no weight), at most one chunk of logits at a time (vocab_loss.py)
        h_rows, y_rows = hidden, labels.reshape(-1)[rows]
        if position_weighting != "dpace":
            row_weights = weights.reshape(-1)[rows] / denom
        else:  # the weights need every slot's CE: the head forms them after its chunks and then scales its rows

            def row_weights(ce_rows):
                nonlocal weights
                prob = torch.zeros(binary.numel(), dtype=torch.float32, device=binary.device)
                prob = prob.index_copy(0, rows, torch.exp(-ce_rows.float())).view_as(binary)
                weights = binary * dpace_weights(prob, binary, dpace_alpha)
                return weights.reshape(-1)[rows] / denom

        loss, ce_rows, argmax_rows = lm_head_cross_entropy(
            h_rows, drafter.lm_head.weight, y_rows, row_weights, vocab_chunk_rows, kernels
        )
        argmax = torch.full_like(labels, -1).view(-1).index_copy(0, rows, argmax_rows).view_as(labels)
        sample_wce = torch.zeros(bsz, dtype=torch.float32, device=h_rows.device).index_add_(
            0, rows // (n * blk), (weights.reshape(-1)[rows] * ce_rows.detach()).float()
        )
    with torch.no_grad():
        correct = (argmax == labels).float() * binary
        accuracy = correct.sum() / (binary.sum() + 1e-6)
        slot_correct = correct.sum((0, 1))
        slot_count = binary.sum((0, 1))
        sample_loss = sample_wce / (norm_weights.sum((1, 2)) + 1e-6)
    out = LossOutput(loss, accuracy, slot_correct, slot_count, num_blocks)
    out.weight_sum = norm_weights.sum().detach()
    out.sample_loss, out.sample_correct, out.sample_count = sample_loss, correct.sum((1, 2)), binary.sum((1, 2))
    if return_logits:
        out.logits = logits
        out.extras = {
            "hidden": hidden, "labels": labels, "binary": binary, "weights": weights, "ce": ce,
            "block_ids": ids, "position_ids": torch.cat([ctx_pos, pos], dim=1),
            "dense_mask": block_mask_dense(anchors.positions, anchors.keep, s_len, blk, None, anchors.starts),
        }
    out.finite = torch.isfinite(loss.detach()) | ~binary.any()
    return out
