"""The trainer ranks' process group, with its rendezvous store bound to MASTER_ADDR only.

Why not torch's `env://` rendezvous: rank 0's TCPStore there listens on every interface (the
libuv server binds "::"/0.0.0.0 whatever MASTER_ADDR says), so on a single node the store
that hands out the group's addresses was reachable from the network. Here rank 0 binds the
listening socket itself, to MASTER_ADDR (127.0.0.1 when every rank shares a node; rank 0's
address as given on several nodes), and hands it to the TCPStore (`master_listen_fd`); the
other ranks connect as before. On a single node gloo's (and NCCL's bootstrap) listeners go to
the loopback interface too, unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are set already.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

LOOPBACK_IFNAME = "lo"  # Linux's loopback interface


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port` only (never the wildcard address)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"the trainers' rendezvous store cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def rendezvous_store(env: dict[str, str], timeout: datetime.timedelta):
    """The group's TCPStore: rank 0 serves it on MASTER_ADDR:MASTER_PORT only, the others join."""
    import torch.distributed as dist

    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout)
    fd = listen_socket(host, port).detach()  # the store owns the descriptor from here on
    return dist.TCPStore(host, port, world, True, timeout, multi_tenant=True, master_listen_fd=fd)


def init_process_group(env: dict[str, str], backend: str, timeout: datetime.timedelta) -> None:
    """torch.distributed's default group from the rank's environment (MASTER_ADDR/PORT, RANK,
    WORLD_SIZE, LOCAL_RANK) over `rendezvous_store`; on one node, gloo and NCCL listen on
    loopback. NCCL with several ranks binds the rank's GPU (`device_id`), as DeepSpeed's own
    init does."""
    import torch
    import torch.distributed as dist

    if is_loopback(env["MASTER_ADDR"]) and LOOPBACK_IFNAME in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
    world = int(env["WORLD_SIZE"])
    extra = {}
    if backend == "nccl" and world > 1:
        extra["device_id"] = torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
    store = rendezvous_store(env, timeout)
    dist.init_process_group(backend, store=store, rank=int(env["RANK"]), world_size=world, timeout=timeout, **extra)
