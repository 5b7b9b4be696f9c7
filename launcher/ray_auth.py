"""Token authentication for the Ray clusters this project starts on more than one machine.

A multi-node Ray cluster listens on the node's interface (GCS, raylets, object managers), so
anyone who reaches those ports could submit work, i.e. run code, unless the cluster demands a
token. Ray 2.60 does (`RAY_AUTH_MODE=token`: every gRPC and dashboard request must carry the
cluster's token); this module is where the project turns it on, in one place:

- `auth_env` / `with_auth` (dflash_dist/orchestration/ray_token.py): the environment a Ray process
  (head, worker, driver, CLI) needs to use a token.
- The cluster launcher (launcher/cluster*.yaml): `dflash-dist cluster-token CLUSTER_YAML`, run
  before `ray up` in the checkout, writes a new random token (mode 0600, never printed) to the
  local file the YAML's `file_mounts` copy to `~/dflash-ray-token` on every node (rsync keeps
  the mode); the YAML's start commands are `dflash-dist ray-start ...`, which refuses to start
  Ray without that file (or with one others can read) and otherwise runs `ray start` with token
  auth on. The same local file lets `ray job submit` through the tunnel authenticate.
- Slurm (launcher/slurm_ray.py): one new token per job, passed in the environment (srun hands it
  to the other nodes), never written to disk.

A single-node run (`ray.init` of pipeline.ray_session) binds 127.0.0.1 only, with a token of its
own process that is never written to disk (ray_token.local_cluster_auth), not Ray's default
~/.ray/auth_token (written with the umask's mode, readable by every local user).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

from dflash_dist.orchestration.ray_system import head_start_args
from dflash_dist.orchestration.ray_token import new_token, with_auth

REMOTE_TOKEN = "~/dflash-ray-token"  # the token on every node of a launcher-made cluster
START_COMMAND = "dflash-dist ray-start"  # what every `ray start` of the cluster YAMLs runs through


def write_token(path: str | os.PathLike[str], token: str | None = None) -> Path:
    """A token file at `path`: created mode 0600 at a temporary name beside it (never readable by
    others, not even while written), fsynced, renamed over `path`, the directory synced."""
    from data_pipeline.durable_files import atomic_writer

    path = Path(path)
    with atomic_writer(path, private=True) as f:
        f.write(new_token() if token is None else token)
    return path


def token_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot serve as a cluster's token file, or None."""
    path = Path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return f"{path} does not exist"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others could read the token; chmod 600 it"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return (f"{path} cannot be read as a token file ({type(e).__name__}: {e}); write a new one with "
                "`dflash-dist cluster-token CLUSTER_YAML --new`")
    if len(text) < 32 or not text.isalnum():
        return f"{path} does not hold a token (32 or more letters and digits)"
    return None


def start_problems(cluster: dict, where: str) -> list[str]:
    """What in a cluster-launcher YAML would start Ray without token auth: a start command not
    through `dflash-dist ray-start`, or no file mount of the token."""
    problems = []
    for field in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in cluster.get(field) or []:
            if "ray start" in cmd and START_COMMAND not in cmd:
                problems.append(f"{where}: {field}: {cmd.strip()!r} starts Ray without token auth: use "
                                f"`{START_COMMAND} ...` (the same arguments)")  # fmt: skip
    if REMOTE_TOKEN not in (cluster.get("file_mounts") or {}):
        problems.append(f"{where}: file_mounts has no {REMOTE_TOKEN!r} entry: the nodes would have no token")
    return problems


def cluster_token_main(argv: list[str]) -> int:
    """`dflash-dist cluster-token CLUSTER_YAML [--new]`: the token file the YAML mounts, made
    before `ray up` (kept if there: `ray up` again on a running cluster; --new: another one,
    for a cluster started after it)."""
    import yaml

    ap = argparse.ArgumentParser(prog="dflash-dist cluster-token")
    ap.add_argument("cluster_yaml", help="a Ray cluster launcher config (launcher/cluster.yaml)")
    ap.add_argument("--new", action="store_true", help="replace an existing token (then `ray up` again)")
    args = ap.parse_args(argv)
    where = args.cluster_yaml
    try:
        cluster = yaml.safe_load(Path(where).read_text())
    except (OSError, yaml.YAMLError) as e:
        print(f"dflash-dist cluster-token: {where}: {e}", file=sys.stderr)
        return 2
    problems = start_problems(cluster if isinstance(cluster, dict) else {}, where)
    if problems:
        print(
            "dflash-dist cluster-token: refusing a cluster without token auth:\n  " + "\n  ".join(problems),
            file=sys.stderr,
        )
        return 2
    local = Path(os.path.expanduser(cluster["file_mounts"][REMOTE_TOKEN]))  # as `ray up` resolves it: from the cwd
    if local.exists() and not args.new:
        problem = token_file_problem(local)
        if problem:
            print(f"dflash-dist cluster-token: {problem}", file=sys.stderr)
            return 1
        print(f"{local}: kept (the cluster's token; --new replaces it)")
        return 0
    write_token(local)
    print(f"{local}: a new token, mode 0600 (`ray up {where}` copies it to {REMOTE_TOKEN} on every node; "
          f"keep it out of git and share it only with who may run jobs)")  # fmt: skip
    return 0


def ray_start_main(argv: list[str]) -> int:
    """`dflash-dist ray-start ARGS`: `ray start ARGS` with token auth on, from ~/dflash-ray-token;
    refused (exit 2) without a usable token file, so a node never joins or serves without it."""
    path = Path(os.path.expanduser(REMOTE_TOKEN))
    problem = token_file_problem(path)
    if problem:
        print(f"dflash-dist ray-start: refusing to start Ray without token authentication: {problem} (the cluster "
              f"launcher copies it there: run `dflash-dist cluster-token CLUSTER_YAML` before `ray up`)",
              file=sys.stderr)  # fmt: skip
        return 2
    ray = str(Path(sys.executable).with_name("ray"))
    env = with_auth(dict(os.environ), token_path=path)
    os.execve(ray, [ray, "start", *argv, *head_start_args(argv)], env)  # a head: no idle workers prestarted
    return 1  # not reached
