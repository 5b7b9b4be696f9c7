"""The trainer ranks' process group, with its rendezvous store bound to MASTER_ADDR only.

Why not torch's `env://` rendezvous: rank 0's TCPStore there listens on every interface (the
libuv server binds "::"/0.0.0.0 whatever MASTER_ADDR says), so on a single node the store
that hands out the group's addresses was reachable from the network. Here rank 0 binds the
listening socket itself, to MASTER_ADDR (127.0.0.1 when every rank shares a node; on several
nodes rank 0's address as given, or, for a name this node resolves to loopback, the node's
network address: node_address.network_address), and hands it to the TCPStore
(`master_listen_fd`); the other ranks dial that address (a rank on rank 0's node whose host
name resolves to loopback too). gloo's listeners (and, on one node, NCCL's bootstrap) go to one
interface (`socket_ifname_env`): loopback on one node; on several, the interface holding the
address this node reaches rank 0 from (gloo would bind what the host name resolves to, loopback
on Debian-style hosts, and the other nodes could not connect). GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME set by the user are kept.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from dflash_dist.node_address import LOOPBACK_IFNAME, interface_of, is_loopback, network_address, resolve, route_source

log = logging.getLogger(__name__)
GLOO_IFNAME, NCCL_IFNAME = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"


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


def master_bind_address(host: str) -> str:
    """The address rank 0's store binds (and, for the interface, the address of rank 0 as this node
    finds it): a loopback MASTER_ADDR as given (a one-node group), else network_address (what the name
    resolves to, beyond loopback)."""
    try:
        return host if is_loopback(host) else network_address(host)
    except socket.gaierror as e:  # its own text names no host
        raise OSError(f"MASTER_ADDR {host} does not resolve on {socket.gethostname()}: {e.strerror}") from e


def master_dial_address(host: str) -> str:
    """Where the other ranks find rank 0's store: MASTER_ADDR as given, so the store's client tries
    every address the name resolves to (a dual-stack name: IPv6 first on some nodes, while rank 0
    bound an IPv4 address); only a name this node resolves to loopback becomes the node's network
    address: a rank on rank 0's node whose /etc/hosts maps the node's name to loopback dialled
    loopback, where nothing listens, until the store's timeout."""
    if is_loopback(host):
        return host
    try:
        resolved = resolve(host)
    except socket.gaierror as e:  # its own text names no host
        raise OSError(f"MASTER_ADDR {host} does not resolve on {socket.gethostname()}: {e.strerror}") from e
    return master_bind_address(host) if is_loopback(resolved) else host


def rendezvous_store(env: dict[str, str], timeout: datetime.timedelta):
    """The group's TCPStore: rank 0 serves it on MASTER_ADDR:MASTER_PORT only, the others join."""
    import torch.distributed as dist

    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if rank != 0:
        return dist.TCPStore(master_dial_address(host), port, world, False, timeout)
    # a name of rank 0's node for the other nodes (a loopback MASTER_ADDR is a one-node group): bound to
    # the address they reach, even where this node resolves its own name to loopback (network_address)
    address = master_bind_address(host)
    fd = listen_socket(address, port).detach()  # the store owns the descriptor from here on
    return dist.TCPStore(address, port, world, True, timeout, multi_tenant=True, master_listen_fd=fd)


def socket_ifname_env(env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The socket interface variables a rank with process-group environment `env` sets, those the
    user set in `environ` left out. One node (a loopback MASTER_ADDR): gloo and NCCL on loopback.
    Several: GLOO_SOCKET_IFNAME is the interface holding this node's address toward rank 0 (rank 0's
    own bound address, or the source of this node's route to it): unset, gloo binds what the host
    name resolves to, loopback under Debian's `127.0.1.1 host`, and the other nodes' ranks could not
    connect. NCCL is left to its own choice there (it skips loopback and prefers InfiniBand's IPoIB)."""
    if is_loopback(env["MASTER_ADDR"]):
        if LOOPBACK_IFNAME not in {name for _, name in socket.if_nameindex()}:
            return {}
        return {k: LOOPBACK_IFNAME for k in (GLOO_IFNAME, NCCL_IFNAME) if k not in environ}
    if GLOO_IFNAME in environ:
        return {}
    try:
        master = master_bind_address(env["MASTER_ADDR"])  # an error here is raised again by the store
        own = route_source(master, int(env["MASTER_PORT"]))
        if own is None:
            raise OSError(f"this node has no route to rank 0's address {master}")
        return {GLOO_IFNAME: interface_of(own)}
    except OSError as e:
        log.warning("%s not set: gloo binds what this node's name (%s) resolves to, which ranks on other nodes may "
                    "not reach (%s); set %s to the interface of the network the nodes share", GLOO_IFNAME,
                    socket.gethostname(), e, GLOO_IFNAME)
        return {}


def init_process_group(env: dict[str, str], backend: str, timeout: datetime.timedelta) -> None:
    """torch.distributed's default group from the rank's environment (MASTER_ADDR/PORT, RANK,
    WORLD_SIZE, LOCAL_RANK) over `rendezvous_store`; gloo (the CPU group, and the GPU ranks' gloo
    side group made later) and NCCL listen where `socket_ifname_env` says, set in this process's
    environment. NCCL with several ranks binds the rank's GPU (`device_id`), as DeepSpeed's own
    init does."""
    import torch
    import torch.distributed as dist

    os.environ.update(socket_ifname_env(env, os.environ))
    world = int(env["WORLD_SIZE"])
    extra = {}
    if backend == "nccl" and world > 1:
        extra["device_id"] = torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
    store = rendezvous_store(env, timeout)
    dist.init_process_group(backend, store=store, rank=int(env["RANK"]), world_size=world, timeout=timeout, **extra)


def interpreter_bin_first() -> None:
    """Put this interpreter's bin directory first on PATH, as an activated venv does. DeepSpeed
    JIT-builds its ops with the first `ninja` on PATH, and pip's (a DeepSpeed dependency, in the
    venv) and the system's do not accept each other's build log: a Ray run from a venv that is not
    activated and a Slurm job (which puts the venv on PATH) rebuilt the op at every switch."""
    bin_dir = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if parts[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *[x for x in parts if x and x != bin_dir]])


def join_group(env: dict[str, str], on_gpu: bool) -> None:
    """Join the ranks' process group (gloo on CPU, NCCL on GPU) through our own rendezvous, whose
    store listens on MASTER_ADDR only (rendezvous.py), then let DeepSpeed adopt the group."""
    import deepspeed
    from deepspeed.constants import default_pg_timeout

    backend = "nccl" if on_gpu else "gloo"
    init_process_group(env, backend, default_pg_timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
