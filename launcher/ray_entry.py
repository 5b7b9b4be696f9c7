"""Entry point for the Ray cluster launcher:

    ray submit launcher/cluster.yaml launcher/ray_entry.py -- CONFIG [--out DIR] [--resume ...] [key=value ...]

`ray submit` copies this file to the head node's home directory and runs it there with the
head's Python, where `setup_commands` installed the project (launcher/cluster.yaml). It joins
the running cluster (RAY_ADDRESS=auto unless set) with the cluster's token (~/dflash-ray-token,
which `ray up` copied there; launcher/ray_auth.py) unless RAY_AUTH_MODE is set, resolves relative paths against the
project checkout as `dflash-dist run` does in one, and calls the same CLI. Nothing else happens
here (STYLE 1): placement, roles and outputs are the pipeline's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def project_root() -> Path:
    """The installed project's checkout (this file's copy in ~ is not inside it)."""
    import launcher

    return Path(launcher.__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_ADDRESS", "auto")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from dflash_dist.orchestration.ray_token import set_auth
    from launcher.ray_auth import REMOTE_TOKEN

    token = Path(os.path.expanduser(REMOTE_TOKEN))
    if "RAY_AUTH_MODE" not in os.environ and token.exists():  # the cluster's, not a user's RAY_AUTH_TOKEN
        set_auth(os.environ, token_path=token)
    os.chdir(project_root())
    from launcher.cli import main as cli_main

    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
