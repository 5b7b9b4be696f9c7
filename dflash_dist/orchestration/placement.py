"""Where the roles run: one Ray placement group with a bundle per role process (each target
actor, each trainer rank, the evaluator), derived from the config in one place (STYLE 4).

A bundle holds exactly what its actor requests (the role's CPUs and GPUs from capture.*,
train.* and eval.*) plus a sliver of the role's node resource (ray.node_resources.<role>), a
custom resource that only the intended nodes declare, so the role lands only there. Reserving
every bundle at once, before any actor starts, means a run either gets all its GPUs or says
which it cannot get, instead of half-starting and waiting forever. `plan_placement` is pure
(testable without Ray); `actor_placement` turns a plan into an actor's Ray options.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_dist.config import Config, ConfigError

NODE_RESOURCE_AMOUNT = 0.001  # of a role's node resource per bundle: a constraint, not a quota
STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK"}


@dataclass(frozen=True)
class PlacementPlan:
    strategy: str  # Ray's name: PACK, SPREAD or STRICT_PACK
    bundles: tuple[dict[str, float], ...]
    roles: tuple[tuple[str, int], ...]  # (role, index within the role) of each bundle

    def bundle_index(self, role: str, index: int) -> int:
        return self.roles.index((role, index))


def role_bundle(cfg: Config, role: str) -> dict[str, float]:
    """The resources one process of `role` ("target", "trainer", "evaluator") requests."""
    cpus, gpus = {
        "target": (cfg.capture.cpus_per_actor, cfg.capture.gpus_per_actor),
        "trainer": (cfg.train.cpus_per_rank, cfg.train.gpus_per_rank),
        "evaluator": (cfg.eval.num_cpus, cfg.eval.num_gpus),
    }[role]
    bundle = {}
    if cpus > 0:
        bundle["CPU"] = float(cpus)
    if gpus > 0:
        bundle["GPU"] = float(gpus)
    node = getattr(cfg.ray.node_resources, role)
    if node:
        bundle[node] = NODE_RESOURCE_AMOUNT
    return bundle


def role_counts(cfg: Config, stages: tuple[str, ...]) -> dict[str, int]:
    """How many processes of each role the given stages start."""
    counts = {}
    if "extract" in stages:
        counts["target"] = cfg.capture.num_actors
    if "train" in stages:
        counts["trainer"] = cfg.train.world_size
    if "eval" in stages and cfg.eval.enabled:
        counts["evaluator"] = 1
    return counts


def plan_placement(cfg: Config, stages: tuple[str, ...]) -> PlacementPlan | None:
    """The placement group for these stages; None when ray.placement is none or no role runs."""
    if cfg.ray.placement == "none":
        return None
    bundles, roles = [], []
    for role, n in role_counts(cfg, stages).items():
        bundle = role_bundle(cfg, role)
        if not bundle:
            raise ConfigError(
                f"ray.placement={cfg.ray.placement}: the {role} role requests no CPU, GPU or node resource, and a "
                "placement group bundle cannot be empty; give it CPUs/GPUs or set ray.placement=none"
            )
        bundles += [bundle] * n
        roles += [(role, i) for i in range(n)]
    if not bundles:
        return None
    return PlacementPlan(STRATEGIES[cfg.ray.placement], tuple(bundles), tuple(roles))


def actor_placement(cfg: Config, role: str, index: int, plan: PlacementPlan | None, pg) -> dict:
    """The Ray actor options that put process `index` of `role` where the config assigns it:
    its bundle of the placement group `pg`, or (no placement group) its node resource."""
    if pg is None:
        node = getattr(cfg.ray.node_resources, role)
        return {"resources": {node: NODE_RESOURCE_AMOUNT}} if node else {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=plan.bundle_index(role, index),
            placement_group_capture_child_tasks=False,
        )
    }


def reserve(ray, plan: PlacementPlan | None, timeout_s: float):
    """Create the placement group and wait until every bundle is placed; None without a plan.
    Raises TimeoutError naming the bundles and what the cluster has."""
    if plan is None:
        return None
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(list(plan.bundles), strategy=plan.strategy, name="")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        wanted = ", ".join(f"{role}[{i}] {b}" for (role, i), b in zip(plan.roles, plan.bundles))
        raise TimeoutError(
            f"the cluster could not place the {plan.strategy} placement group within {timeout_s:.0f}s "
            f"(ray.placement_timeout_s): wanted {wanted}; the cluster has {ray.cluster_resources()}, "
            f"free {ray.available_resources()}. "
            "Add nodes (or declare the ray.node_resources names on them), lower the per-role CPUs/GPUs, or set "
            "ray.placement=none"
        )
    return pg


def release(pg) -> None:
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
