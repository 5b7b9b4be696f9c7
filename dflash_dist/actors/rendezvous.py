"""The trainer ranks' process group, with its rendezvous store bound to MASTER_ADDR only.

Why not torch's `env://` rendezvous: rank 0's TCPStore there listens on every interface (the
libuv server binds "::"/0.0.0.0 whatever MASTER_ADDR says), so on a single node the store
that hands out the group's addresses was reachable from the network. Here rank 0 binds the
listening socket itself, to MASTER_ADDR (127.0.0.1 when every rank shares a node; on several
nodes rank 0's address as given, or, for a name this node resolves to loopback, the node's
network address: network_address), and hands it to the TCPStore (`master_listen_fd`); the
other ranks connect as before. On a single node gloo's (and NCCL's bootstrap) listeners go to
the loopback interface too, unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are set already.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

LOOPBACK_IFNAME = "lo"  # Linux's loopback interface
# a destination to find the default route's source address (a UDP connect sends no packet; Ray's own
# node IP detection asks the same way)
ROUTE_PROBE = ("8.8.8.8", 53)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def network_address(host: str) -> str:
    """The address of this node, named `host`, that the other nodes reach: what `host` resolves to,
    unless that is a loopback address (an /etc/hosts line `127.0.1.1 host`, Debian's and many cloud
    images' default, or `127.0.0.1 host`), then the source address of this node's default route.
    Bound to loopback, a service the other nodes were told to find at `host` is unreachable to them:
    they resolve the name to the node's real address and are refused. Raises OSError naming the
    fix when neither gives an address beyond loopback."""
    resolved = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    if not is_loopback(resolved):
        return resolved
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(ROUTE_PROBE)
            routed = probe.getsockname()[0]
    except OSError:
        routed = None
    if routed is None or is_loopback(routed):
        raise OSError(f"{host} resolves to {resolved} (loopback) on this node and it has no default route: the "
                      f"other nodes cannot reach a service bound there; map {host} to this node's cluster address "
                      "in /etc/hosts (or DNS)")
    return routed


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
    # a name of rank 0's node for the other nodes (a loopback MASTER_ADDR is a one-node group): bound to
    # the address they reach, even where this node resolves its own name to loopback (network_address)
    bind = host if is_loopback(host) else network_address(host)
    fd = listen_socket(bind, port).detach()  # the store owns the descriptor from here on
    return dist.TCPStore(bind, port, world, True, timeout, multi_tenant=True, master_listen_fd=fd)


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
