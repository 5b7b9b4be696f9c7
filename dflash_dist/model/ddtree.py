"""DDTree: a tree of drafts from one DFlash drafter pass, and how it is verified.

The drafter emits one distribution per block slot. Scoring a path by the sum of its slots'
log-probs, the best tree under a node budget N is the N most likely prefixes; a best-first
heap finds it without enumerating the vocabulary. The construction and verification walk
follow liranringel/ddtree (`build_ddtree_tree`, `follow_verified_tree`) so that trees match
the golden fixtures exactly (SPEC.md section 5, golden README section 4).

Flat indexing: index 0 is the root (the anchor/bonus token, not drafted); the i-th popped
node has flat index i + 1.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DraftTree:
    """One round's draft tree; lists are indexed in pop order (node i = flat index i+1)."""

    node_token_ids: list[int]
    node_depths: list[int]
    parents: list[int]  # length n+1, parents[0] = -1 for the root
    child_maps: list[dict[int, int]]  # per flat index: token id -> child flat index
    node_logprobs: list[float]  # path log-prob of each node (length n, root excluded)

    def visibility(self) -> torch.Tensor:
        """Bool [n+1, n+1] tree-attention mask: each row sees itself and its ancestors."""
        size = len(self.parents)
        vis = torch.zeros((size, size), dtype=torch.bool)
        vis[0, 0] = True
        for index in range(1, size):
            # Parents precede children in pop order, so the parent's row is already final.
            vis[index, :index] = vis[self.parents[index], :index]
            vis[index, index] = True
        return vis

    def position_offsets(self) -> list[int]:
        """Verify position of each flat index relative to the root (= its depth)."""
        return [0, *self.node_depths]


def build_ddtree(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    """Pick the `budget` most likely draft prefixes, best first.

    draft_logits is [depth, V]; row i is drafter slot i+1, i.e. tree depth i+1.
    """
    if draft_logits.dim() != 2:
        raise ValueError(
            f"draft_logits must be [depth, vocab], got shape {tuple(draft_logits.shape)}"
        )
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    depth_limit, vocab = draft_logits.shape
    if budget == 0 or depth_limit == 0 or vocab == 0:
        return DraftTree([], [], [-1], [{}], [])
    # ranked where the logits are, as replay's block_drafts ranks them: live and replay build their
    # trees from the same top-k (a device's top-k may order exact ties unlike the host's)
    top_logq, top_tokens = top_logprobs(draft_logits, min(budget, vocab))
    return ddtree_from_top(top_logq[0], top_tokens[0], budget)


def top_logprobs(draft_logits: torch.Tensor, k: int) -> tuple[list, list]:
    """The top-k log-probs and token ids of every slot, as lists: `draft_logits` [..., depth, V]
    (any leading batch dims, any device) -> ([..][depth][k] floats, [..][depth][k] ints), computed
    in float32 where the logits are, so a batch of rounds (evaluator/batched_replay.py) needs one
    device op and one copy to the host instead of one per round. What build_ddtree needs of a
    round's logits: build_ddtree(logits, b) == ddtree_from_top(*top_logprobs(logits[None], b), b)
    (first rows)."""
    logits = draft_logits.detach().float()
    if logits.dim() == 2:
        logits = logits[None]
    top_logits, top_ids = torch.topk(logits, k=k, dim=-1)
    top_logq = top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return top_logq.cpu().tolist(), top_ids.cpu().tolist()


def ddtree_from_top(top_logq: list[list[float]], top_tokens: list[list[int]], budget: int) -> DraftTree:
    """build_ddtree from one round's top log-probs ([depth][k], best first per slot) and their
    token ids: k = min(budget, V) columns."""
    node_token_ids: list[int] = []
    node_depths: list[int] = []
    node_logprobs: list[float] = []
    parents = [-1]
    child_maps: list[dict[int, int]] = [{}]
    depth_limit = len(top_logq)
    if budget == 0 or depth_limit == 0 or not top_logq[0]:
        return DraftTree(node_token_ids, node_depths, parents, child_maps, node_logprobs)
    topk = len(top_logq[0])

    # Entries: (-score, rank path, parent flat index, depth, rank, score). The rank path is
    # unique per candidate, so exact score ties resolve deterministically, as in the reference.
    first = top_logq[0][0]
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = [
        (-first, (0,), 0, 1, 0, first)
    ]
    while heap and len(node_token_ids) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        token = top_tokens[depth - 1][rank]
        index = len(node_token_ids) + 1
        node_token_ids.append(token)
        node_depths.append(depth)
        node_logprobs.append(score)
        parents.append(parent)
        child_maps.append({})
        child_maps[parent][token] = index

        if rank + 1 < topk:
            row = top_logq[depth - 1]
            sibling = score - row[rank] + row[rank + 1]
            heapq.heappush(
                heap,
                (-sibling, (*ranks[:-1], rank + 1), parent, depth, rank + 1, sibling),
            )
        if depth < depth_limit:
            child = score + top_logq[depth][0]
            heapq.heappush(heap, (-child, (*ranks, 0), index, depth + 1, 0, child))

    return DraftTree(node_token_ids, node_depths, parents, child_maps, node_logprobs)


def follow_verified_tree(
    child_maps: Sequence[dict[int, int]], posterior: Sequence[int]
) -> tuple[list[int], int]:
    """Walk from the root along the target's choices; return (accepted flat indices, bonus).

    posterior[i] is the token the target picked after flat index i. The accepted list starts
    with the root, so its length is tau for the round.
    """
    accepted = [0]
    current = 0
    next_token = int(posterior[0])
    while next_token in child_maps[current]:
        current = child_maps[current][next_token]
        accepted.append(current)
        next_token = int(posterior[current])
    return accepted, next_token


def walk_tree_against_reference(tree: DraftTree, reference: Sequence[int]) -> int:
    """Greedy replay: count drafted nodes accepted when the target's continuation is known.

    reference[d] is the target's greedy token d+1 steps below the root. Equivalent to
    follow_verified_tree with posterior[i] = reference[depth(i)]; tau = result + 1.
    """
    current = 0
    accepted = 0
    while accepted < len(reference):
        child = tree.child_maps[current].get(int(reference[accepted]))
        if child is None:
            break
        current = child
        accepted += 1
    return accepted


def chain_acceptance(draft_tokens: Sequence[int], reference: Sequence[int]) -> int:
    """Accepted drafts for a plain DFlash chain: length of the matching prefix."""
    accepted = 0
    for drafted, target in zip(draft_tokens, reference):
        if int(drafted) != int(target):
            break
        accepted += 1
    return accepted


def compare_with_golden(path: str | Path) -> list[tuple[str, bool, str]]:
    """Rebuild every tree of a golden ddtree.json and re-run its verify cases.

    Returns one (name, ok, detail) row per (case, budget); detail names the first mismatch.
    """
    data = json.loads(Path(path).read_text())
    rows: list[tuple[str, bool, str]] = []
    for case in data["cases"]:
        logits = torch.tensor(case["draft_logits"], dtype=torch.float32)
        for expected in case["trees"]:
            name = f"{case['name']}/budget={expected['budget']}"
            tree = build_ddtree(logits, expected["budget"])
            mismatches = _tree_mismatches(tree, expected)
            rows.append((name, not mismatches, "; ".join(mismatches) or "identical"))
    return rows


def _tree_mismatches(tree: DraftTree, expected: dict) -> list[str]:
    """Field-by-field exact comparison of one rebuilt tree with its golden record."""
    got = {
        "node_token_ids": tree.node_token_ids,
        "node_depths": tree.node_depths,
        "parents": tree.parents,
        "child_maps": [list(m.items()) for m in tree.child_maps],
        "visibility": tree.visibility().int().tolist(),
        "position_offsets": tree.position_offsets(),
    }
    want = {key: expected[key] for key in got}
    # JSON object keys are strings; keep insertion order, since it is part of the contract.
    want["child_maps"] = [
        [(int(k), v) for k, v in m.items()] for m in expected["child_maps"]
    ]
    problems = [f"{key} differs" for key in got if got[key] != want[key]]
    for case in expected["verify"]:
        accepted, next_token = follow_verified_tree(tree.child_maps, case["posterior"])
        if accepted != case["accepted_indices"] or next_token != case["next_token"]:
            problems.append(
                f"verify {case['name']}: got {accepted}/{next_token}, "
                f"want {case['accepted_indices']}/{case['next_token']}"
            )
    return problems
