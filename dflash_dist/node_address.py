"""Where this node is on the network: the address the other nodes reach it at, the interface that
carries an address, and how an error names the node.

Debian's and many cloud images' /etc/hosts map a host's own name to a loopback address
(`127.0.1.1 host`, or `127.0.0.1 host`). Whatever binds "the address this host name resolves to"
then listens on loopback, and the other nodes, which resolve the name to the node's real address,
are refused: the Ray head of a Slurm job, rank 0's rendezvous store, and gloo's listeners (gloo
binds what the host name resolves to unless GLOO_SOCKET_IFNAME names an interface).
`network_address` is the node's address beyond loopback; `interface_of` the interface holding it.
"""

from __future__ import annotations

import ipaddress
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


def resolve(host: str) -> str:
    """The first address `host` resolves to on this node (an address resolves to itself)."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def route_source(address: str, port: int = ROUTE_PROBE[1]) -> str | None:
    """The source address this node's connections to `address` leave from (the kernel's route;
    a UDP connect sends nothing), or None when there is no route."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, port))
            return probe.getsockname()[0]
    except OSError:
        return None


def network_address(host: str) -> str:
    """The address of this node, named `host`, that the other nodes reach: what `host` resolves to,
    unless that is a loopback address (an /etc/hosts line `127.0.1.1 host`, Debian's and many cloud
    images' default, or `127.0.0.1 host`), then the source address of this node's default route.
    Bound to loopback, a service the other nodes were told to find at `host` is unreachable to them:
    they resolve the name to the node's real address and are refused. Raises OSError naming the
    fix when neither gives an address beyond loopback."""
    resolved = resolve(host)
    if not is_loopback(resolved):
        return resolved
    routed = route_source(ROUTE_PROBE[0])
    if routed is None or is_loopback(routed):
        raise OSError(f"{host} resolves to {resolved} (loopback) on this node and it has no default route: the "
                      f"other nodes cannot reach a service bound there; map {host} to this node's cluster address "
                      "in /etc/hosts (or DNS)")
    return routed


def interface_of(address: str) -> str:
    """The name of this node's network interface that holds `address` (127.0.0.1 -> lo; a loopback
    address that no interface lists, such as 127.0.0.2, is on the loopback interface). Raises
    OSError naming the address and this node's interfaces when none holds it."""
    import psutil

    want = ipaddress.ip_address(address.split("%")[0])
    held: list[str] = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            got = ipaddress.ip_address(a.address.split("%")[0])
            if got == want:
                return name
            held.append(f"{name} {got}")
    if want.is_loopback and LOOPBACK_IFNAME in {name for _, name in socket.if_nameindex()}:
        return LOOPBACK_IFNAME
    raise OSError(f"no network interface of this node holds {address} (it has: {', '.join(held) or 'none'})")


def node_label() -> str:
    """This node as an error names it: its host name and its network address ("gpu-b (10.0.0.7)")."""
    host = socket.gethostname()
    try:
        return f"{host} ({network_address(host)})"
    except OSError:
        return f"{host} (no address beyond loopback)"
