"""Where the Ray clusters we start keep their session files: inside a directory only this user can enter.

Ray 2.60 makes its temp directory and every directory of a session in it mode 0777, "so others
can use it" (`try_to_create_directory`, chmod on every start): /tmp/ray by default, and also a
`--temp-dir`/`_temp_dir` given, whatever mode it was made with (a `mkdtemp` directory, 0700,
became 0777; measured). There, without a sticky bit, live the unix sockets our Ray processes
connect to, the log files they write, and `runtime_resources/`, where a working_dir package
already present under its content hash is used as found. Any local user of the node could
replace a socket, plant a link where a log is written, or a package our processes import. So
the temp directory is `ray/` inside a fresh `mkdtemp` directory: Ray opens its own directory
wide, but its parent (0700, ours) lets nobody else reach it. The parent is short, under /tmp
(Ray's socket paths must fit 107 bytes), and removed when the cluster stops.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

RAY_DIR = "ray"  # the directory Ray is given, inside the private one


def make_private_ray_temp(tag: str = "") -> str:
    """A new temp directory for one Ray node (`<mkdtemp 0700>/ray`; Ray creates `ray/` itself):
    remove its parent, `os.path.dirname` of it, when the node has stopped."""
    return os.path.join(tempfile.mkdtemp(prefix=f"dfray-{tag}", dir="/tmp"), RAY_DIR)


@contextlib.contextmanager
def private_ray_temp(tag: str = "") -> Iterator[str]:
    """make_private_ray_temp for the life of the block, its parent removed after it."""
    temp_dir = make_private_ray_temp(tag)
    try:
        yield temp_dir
    finally:
        shutil.rmtree(os.path.dirname(temp_dir), ignore_errors=True)
