"""DDTree construction and verification: golden parity plus properties on random logits."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from dflash_dist.model.ddtree import (
    DraftTree,
    build_ddtree,
    chain_acceptance,
    compare_with_golden,
    follow_verified_tree,
    walk_tree_against_reference,
)
from tests.conftest import golden_path

GOLDEN_PATH = golden_path() / "ddtree.json"
# A missing golden file is a failure, not a skip: the tests below would otherwise pass vacuously.
needs_golden = pytest.mark.usefixtures("golden_dir")


def _golden_trees() -> list[tuple[str, torch.Tensor, dict]]:
    if not GOLDEN_PATH.exists():
        return [("missing-golden", torch.zeros(1, 1), {})]
    data = json.loads(GOLDEN_PATH.read_text())
    out = []
    for case in data["cases"]:
        logits = torch.tensor(case["draft_logits"], dtype=torch.float32)
        for tree in case["trees"]:
            out.append((f"{case['name']}-b{tree['budget']}", logits, tree))
    return out


GOLDEN = _golden_trees()


def _path_tokens(tree: DraftTree, index: int) -> tuple[int, ...]:
    """Token sequence from the root (exclusive) down to flat index `index`."""
    tokens = []
    while index > 0:
        tokens.append(tree.node_token_ids[index - 1])
        index = tree.parents[index]
    return tuple(reversed(tokens))


@needs_golden
@pytest.mark.parametrize(
    ("logits", "expected"),
    [(g[1], g[2]) for g in GOLDEN],
    ids=[g[0] for g in GOLDEN],
)
def test_golden_tree_exact(logits: torch.Tensor, expected: dict) -> None:
    tree = build_ddtree(logits, expected["budget"])
    assert tree.node_token_ids == expected["node_token_ids"]
    assert tree.node_depths == expected["node_depths"]
    assert tree.parents == expected["parents"]
    want_maps = [[(int(k), v) for k, v in m.items()] for m in expected["child_maps"]]
    assert [list(m.items()) for m in tree.child_maps] == want_maps
    assert tree.visibility().int().tolist() == expected["visibility"]
    assert tree.visibility().dtype == torch.bool
    assert tree.position_offsets() == expected["position_offsets"]
    # Derived, not a reference output: check only to float32 rounding.
    assert tree.node_logprobs == pytest.approx(
        expected["node_path_logprob_derived"][1:], abs=1e-5
    )
    for case in expected["verify"]:
        accepted, next_token = follow_verified_tree(tree.child_maps, case["posterior"])
        assert accepted == case["accepted_indices"], case["name"]
        assert next_token == case["next_token"], case["name"]


@needs_golden
def test_golden_covers_all_cases() -> None:
    # Guard against a silently empty parametrization: 5 cases x 3 budgets.
    assert len(GOLDEN) == 15


@needs_golden
def test_compare_with_golden_all_ok() -> None:
    rows = compare_with_golden(GOLDEN_PATH)
    assert len(rows) == 15
    assert all(ok for _, ok, _ in rows), [r for r in rows if not r[1]]
    assert rows[0][0] == "random_v24/budget=4"


@needs_golden
def test_compare_with_golden_reports_mismatch(tmp_path: Path) -> None:
    data = json.loads(GOLDEN_PATH.read_text())
    tree = data["cases"][0]["trees"][1]
    tree["node_token_ids"][0] += 1
    tree["verify"][1]["next_token"] += 1
    bad = tmp_path / "ddtree.json"
    bad.write_text(json.dumps(data))
    rows = compare_with_golden(bad)
    failed = [r for r in rows if not r[1]]
    assert [r[0] for r in failed] == ["random_v24/budget=8"]
    assert "node_token_ids" in failed[0][2]
    assert "verify top1_chain_to_leaf" in failed[0][2]


def _random_logits(seed: int, depth: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(depth, vocab, generator=gen) * 2.0


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    ("depth", "vocab", "budget"), [(3, 5, 7), (4, 3, 20), (2, 6, 40)]
)
def test_tree_is_top_n_prefixes(seed: int, depth: int, vocab: int, budget: int) -> None:
    logits = _random_logits(seed, depth, vocab)
    logq = torch.log_softmax(logits.double(), dim=-1)
    scores = {}
    for length in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=length):
            scores[path] = sum(float(logq[d, t]) for d, t in enumerate(path))
    tree = build_ddtree(logits, budget)
    n = min(budget, len(scores))
    assert len(tree.node_token_ids) == n
    chosen = {_path_tokens(tree, i) for i in range(1, n + 1)}
    assert len(chosen) == n  # no duplicate prefix
    worst_in = min(scores[p] for p in chosen)
    best_out = max((s for p, s in scores.items() if p not in chosen), default=-math.inf)
    assert worst_in >= best_out - 1e-6
    for i, path in enumerate(_path_tokens(tree, j) for j in range(1, n + 1)):
        assert tree.node_logprobs[i] == pytest.approx(scores[path], abs=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_tree_structure_properties(seed: int, budget: int) -> None:
    depth, vocab = 7, 50
    tree = build_ddtree(_random_logits(seed, depth, vocab), budget)
    n = len(tree.node_token_ids)
    assert n == budget  # 50^7 prefixes: the budget is always filled
    assert len(tree.node_depths) == len(tree.node_logprobs) == n
    assert len(tree.parents) == len(tree.child_maps) == n + 1
    assert tree.parents[0] == -1
    assert all(1 <= d <= depth for d in tree.node_depths)
    assert all(a >= b for a, b in itertools.pairwise(tree.node_logprobs))
    assert all(lp <= 0.0 for lp in tree.node_logprobs)
    for index in range(1, n + 1):
        parent = tree.parents[index]
        assert 0 <= parent < index
        parent_depth = 0 if parent == 0 else tree.node_depths[parent - 1]
        assert tree.node_depths[index - 1] == parent_depth + 1
        assert tree.child_maps[parent][tree.node_token_ids[index - 1]] == index
    assert sum(len(m) for m in tree.child_maps) == n
    # Children are recorded in pop order.
    for m in tree.child_maps:
        assert list(m.values()) == sorted(m.values())
    vis = tree.visibility()
    assert vis.shape == (n + 1, n + 1)
    for index in range(n + 1):
        ancestors = {index}
        walk = index
        while walk > 0:
            walk = tree.parents[walk]
            ancestors.add(walk)
        assert {j for j in range(n + 1) if vis[index, j]} == ancestors
    assert tree.position_offsets() == [0, *tree.node_depths]


def test_exact_score_ties_break_by_rank_path() -> None:
    # Uniform rows make same-depth paths tie exactly; the rank path then decides, so all
    # children of the first depth-1 node pop before those of the second (reference order).
    tree = build_ddtree(torch.zeros(2, 3), 12)
    assert tree.parents == [-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert tree.node_depths == [1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    assert sorted(tree.child_maps[2]) == [0, 1, 2]


def test_depth_bounded_by_rows() -> None:
    # One token dominates every row: the tree is a chain until the rows run out.
    logits = torch.full((3, 10), -20.0)
    logits[:, 4] = 20.0
    tree = build_ddtree(logits, 6)
    assert tree.node_depths[:3] == [1, 2, 3]
    assert max(tree.node_depths) == 3
    assert tree.node_token_ids[:3] == [4, 4, 4]


def test_budget_one_is_greedy_top1() -> None:
    logits = _random_logits(3, 7, 30)
    tree = build_ddtree(logits, 1)
    assert tree.node_token_ids == [int(logits[0].argmax())]
    assert tree.parents == [-1, 0]
    assert tree.child_maps == [{tree.node_token_ids[0]: 1}, {}]
    assert tree.visibility().tolist() == [[True, False], [True, True]]


def test_small_vocab_budget_exceeds_vocab() -> None:
    tree = build_ddtree(_random_logits(1, 2, 3), 100)
    assert len(tree.node_token_ids) == 3 + 9  # every prefix of length <= 2


def test_empty_and_invalid_inputs() -> None:
    tree = build_ddtree(_random_logits(0, 4, 8), 0)
    assert tree.parents == [-1] and tree.child_maps == [{}]
    assert tree.visibility().tolist() == [[True]]
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(_random_logits(0, 4, 8), -1)
    with pytest.raises(ValueError, match="depth, vocab"):
        build_ddtree(torch.zeros(1, 4, 8), 4)


def _tree_and_greedy(seed: int) -> tuple[DraftTree, list[int]]:
    logits = _random_logits(seed, 5, 12)
    return build_ddtree(logits, 16), logits.argmax(dim=-1).tolist()


def test_walk_full_match_along_greedy_chain() -> None:
    tree, greedy = _tree_and_greedy(0)
    chain_len = max(tree.node_depths)
    assert chain_len >= 2
    # The all-top-1 chain is always the first branch grown, down to the deepest node.
    assert walk_tree_against_reference(tree, greedy) == chain_len
    assert walk_tree_against_reference(tree, greedy + [1, 2, 3]) == chain_len
    assert walk_tree_against_reference(tree, greedy[:2]) == 2


def test_walk_no_match_and_empty_reference() -> None:
    tree, _ = _tree_and_greedy(1)
    missing = next(t for t in range(12) if t not in tree.child_maps[0])
    assert walk_tree_against_reference(tree, [missing, *tree.node_token_ids]) == 0
    assert walk_tree_against_reference(tree, []) == 0


def test_walk_follows_a_sibling_branch() -> None:
    tree, _ = _tree_and_greedy(2)
    deepest_non_first = max(
        range(1, len(tree.parents)),
        key=lambda i: (
            _path_tokens(tree, i)[0] != tree.node_token_ids[0],
            tree.node_depths[i - 1],
        ),
    )
    path = _path_tokens(tree, deepest_non_first)
    assert path[0] != tree.node_token_ids[0]
    assert walk_tree_against_reference(tree, list(path)) == len(path)


@pytest.mark.parametrize("seed", range(5))
def test_walk_matches_follow_verified_tree(seed: int) -> None:
    tree, greedy = _tree_and_greedy(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    # Mostly greedy with random deviations, so walks stop at varied depths.
    reference = [
        t
        if torch.rand(1, generator=gen).item() < 0.7
        else int(torch.randint(12, (1,), generator=gen))
        for t in greedy
    ]
    depths = [0, *tree.node_depths]
    posterior = [reference[d] if d < len(reference) else -1 for d in depths]
    accepted, bonus = follow_verified_tree(tree.child_maps, posterior)
    walked = walk_tree_against_reference(tree, reference)
    assert len(accepted) == walked + 1
    assert _path_tokens(tree, accepted[-1]) == tuple(reference[:walked])
    assert bonus == posterior[accepted[-1]]


def test_walk_budget_one_tree() -> None:
    tree = build_ddtree(_random_logits(5, 7, 30), 1)
    token = tree.node_token_ids[0]
    assert walk_tree_against_reference(tree, [token, token, token]) == 1
    assert walk_tree_against_reference(tree, [token + 1]) == 0


def test_follow_verified_tree_rejects_at_root_and_returns_bonus() -> None:
    child_maps = [{7: 1, 8: 2}, {9: 3}, {}, {}]
    assert follow_verified_tree(child_maps, [5, 0, 0, 0]) == ([0], 5)
    assert follow_verified_tree(child_maps, [7, 9, 0, 4]) == ([0, 1, 3], 4)
    assert follow_verified_tree(child_maps, [8, 9, 6, 4]) == ([0, 2], 6)


@pytest.mark.parametrize(
    ("draft", "reference", "expected"),
    [
        ([], [1, 2], 0),
        ([1, 2, 3], [], 0),
        ([4, 2, 3], [1, 2, 3], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 3, 4, 5], 3),
        ([1, 2, 3, 4], [1, 2], 2),
        ([1, 2, 9, 4], [1, 2, 3, 4], 2),
        ([5], [5], 1),
    ],
)
def test_chain_acceptance(
    draft: list[int], reference: list[int], expected: int
) -> None:
    assert chain_acceptance(draft, reference) == expected


def test_chain_equals_budget_one_tree_walk_on_chain() -> None:
    # A single-branch tree grown from a dominant chain behaves like the plain DFlash chain.
    logits = torch.full((4, 10), -30.0)
    chain = [3, 1, 4, 1]
    for d, t in enumerate(chain):
        logits[d, t] = 30.0
    tree = build_ddtree(logits, 4)
    assert tree.node_token_ids == chain
    for reference in ([3, 1, 4, 1], [3, 1, 5, 1], [2], [3, 1, 4, 1, 5]):
        assert walk_tree_against_reference(tree, reference) == chain_acceptance(
            chain, reference
        )
