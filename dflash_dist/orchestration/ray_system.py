"""The Ray system config every cluster this project starts runs with: no idle Python workers ahead of use.

Ray prestarts up to one Python worker per CPU (as many as the node's cores start at once) for the first
driver, and more as jobs start. No actor of a run takes one: each carries its own runtime_env
(compile_cache.actor_runtime_env), so they only hold memory and CPU beside the target (measured: 2 unused
`ray::IDLE` processes on 2 cores; on a GPU node, one per core). The head holds the config for the whole
cluster: worker nodes take it from the head's GCS when they join.
"""

from __future__ import annotations

import json

NO_PRESTART = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


def head_start_args(argv: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`ray start` arguments that start a head with NO_PRESTART; none when `argv` is not a head's or
    already gives its own `--system-config` (the user's choice stands)."""
    if "--head" not in argv or any(a == "--system-config" or a.startswith("--system-config=") for a in argv):
        return []
    return ["--system-config", json.dumps(NO_PRESTART)]
