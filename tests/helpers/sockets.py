"""A process's listening TCP sockets, read from /proc (the kernel's table, as `ss -ltn` shows it):
which address a service really bound (tests/test_rendezvous.py, tests/test_multinode_setup.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def hex_address(field: str) -> tuple[str, int]:
    """A /proc/net/tcp{,6} `ADDR:PORT` (kernel byte order) as (address, port)."""
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four 32-bit words, each in host (little-endian) order
        host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return host, int(port, 16)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` holds in state LISTEN."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: TCP_LISTEN
                found.append(hex_address(cols[1]))
    return found
