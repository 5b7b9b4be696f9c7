"""Free TCP ports for the services we start (process-group masters, Ray heads, test daemons)."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "") -> list[int]:
    """n distinct ports free on `host` ("" = every interface, for peers on other nodes;
    "127.0.0.1" for loopback-only services), held open together while picked."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
