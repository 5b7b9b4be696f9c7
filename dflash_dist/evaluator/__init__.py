"""Checkpoint evaluation: which exports to score (policy.py) and the replay-tau evaluator."""

from dflash_dist.evaluator.evaluator import Evaluator, list_exports
from dflash_dist.evaluator.policy import EvalRequest, EvalResult, pending_steps, should_stop

__all__ = [
    "EvalRequest",
    "EvalResult",
    "Evaluator",
    "list_exports",
    "pending_steps",
    "should_stop",
]
