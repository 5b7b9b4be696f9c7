"""The trainers' process group listens on MASTER_ADDR only: rank 0's rendezvous store (and, on one
node, gloo's pair listeners) on 127.0.0.1, never on every interface; on several nodes the store
on the master address as given, and gloo's listeners on the interface of the node's network
address (GLOO_SOCKET_IFNAME, a user's own kept), not what the host name resolves to.

Two real ranks (subprocesses of this module: `python -m tests.test_rendezvous`) join through
trainer_group.join_group, the call run_rank makes; rank 0 reports its listening sockets, read
from /proc (the kernel's table, as `ss -ltn` shows it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_dist.actors.ports import free_ports
from dflash_dist.actors.trainer_group import default_extensions_dir
from dflash_dist.node_address import interface_of, is_loopback, network_address
from tests.conftest import REPO
from tests.helpers.sockets import listening_sockets


def rank_main(rank: str, master: str, port: str, report: str) -> None:
    import torch.distributed as dist

    from dflash_dist.actors.trainer_group import join_group

    env = {"MASTER_ADDR": master, "MASTER_PORT": port, "RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank,
           "DS_ACCELERATOR": "cpu"}  # fmt: skip
    os.environ.update(env)
    join_group(env, on_gpu=False)
    dist.barrier()  # every gloo pair is connected
    if rank == "0":
        Path(report).write_text(json.dumps({"listening": listening_sockets(os.getpid()),
                                            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}))
    dist.barrier()
    dist.destroy_process_group()


def run_group(tmp_path: Path, master: str) -> tuple[int, list[tuple[str, int]], str | None]:
    """Two ranks joined at `master`: the store's port, rank 0's listening sockets, and the
    GLOO_SOCKET_IFNAME rank 0 ran with."""
    port = free_ports(1, master if is_loopback(master) else network_address(master))[0]
    report = tmp_path / "listening.json"
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())  # DeepSpeed's shm op compiles once
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.test_rendezvous", str(rank), master, str(port), str(report)],
            cwd=REPO,
            env=env | {"OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    got = json.loads(report.read_text())
    return port, [tuple(x) for x in got["listening"]], got["gloo_ifname"]


def test_single_node_group_listens_on_loopback_only(tmp_path):
    port, sockets, _ = run_group(tmp_path, "127.0.0.1")
    assert (("127.0.0.1", port)) in sockets, sockets  # the rendezvous store, on the address given
    assert len(sockets) >= 2, sockets  # the store and gloo's listener(s)
    assert all(is_loopback(host) for host, _ in sockets), f"listening beyond loopback: {sockets}"


def test_store_listens_on_the_given_master_address(tmp_path):
    """Several nodes: MASTER_ADDR is rank 0's address, and the store binds exactly it (127.0.0.2
    stands in for a node's address: another address of this machine, not 127.0.0.1)."""
    try:
        free_ports(1, "127.0.0.2")
    except OSError:
        pytest.fail("this Linux machine should accept binds on 127.0.0.2 (all of 127/8 is loopback)")
    port, sockets, _ = run_group(tmp_path, "127.0.0.2")
    assert [s for s in sockets if s[1] == port] == [("127.0.0.2", port)], sockets


def test_an_address_maps_to_the_interface_holding_it():
    """interface_of: loopback addresses are on lo (127.0.0.2 too, which no interface lists); this
    node's network address on its own interface; an address no interface holds is an OSError naming
    it and what the node has."""
    assert interface_of("127.0.0.1") == interface_of("127.0.0.2") == "lo"
    own = network_address(socket.gethostname())
    assert interface_of(own) != "lo" and interface_of(own) in {name for _, name in socket.if_nameindex()}
    with pytest.raises(OSError, match=r"no network interface of this node holds 203\.0\.113\.9 \(it has: lo 127"):
        interface_of("203.0.113.9")  # TEST-NET-3: documentation only, never a host's


def test_a_multi_node_rank_sets_gloos_interface_unless_the_user_did():
    """socket_ifname_env, what init_process_group puts in a rank's environment. One node: gloo and
    NCCL on lo. Several (MASTER_ADDR rank 0's node name, here this host's, which this machine's
    /etc/hosts resolves to loopback as Debian's `127.0.1.1 host` does): GLOO_SOCKET_IFNAME is the
    interface of the node's network address, for rank 0 and the others alike; it was unset, and gloo
    bound the loopback address the name resolves to, unreachable from every other node. A user's
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME stays theirs; NCCL picks its own interface over nodes."""
    from dflash_dist.actors.rendezvous import socket_ifname_env

    host = socket.gethostname()
    node_if = interface_of(network_address(host))
    for rank in ("0", "1"):
        env = {"MASTER_ADDR": host, "MASTER_PORT": "29500", "RANK": rank, "WORLD_SIZE": "2"}
        assert socket_ifname_env(env, {}) == {"GLOO_SOCKET_IFNAME": node_if}, rank
        assert socket_ifname_env(env, {"GLOO_SOCKET_IFNAME": "ib0"}) == {}
    by_ip = {"MASTER_ADDR": network_address(host), "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    assert socket_ifname_env(by_ip, {}) == {"GLOO_SOCKET_IFNAME": node_if}  # Ray's MASTER_ADDR: rank 0's node IP
    one = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}
    assert socket_ifname_env(one, {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert socket_ifname_env(one, {"NCCL_SOCKET_IFNAME": "eth9"}) == {"GLOO_SOCKET_IFNAME": "lo"}


def test_other_ranks_dial_master_addr_as_given_unless_it_is_loopback_here(monkeypatch):
    """The store's client tries every address a name resolves to, so the ranks dial MASTER_ADDR itself
    (a dual-stack name may resolve IPv6 first on one node while rank 0 bound IPv4); only a name this
    node resolves to loopback (Debian's `127.0.1.1 host` on rank 0's own node) becomes the node's
    network address, which is where rank 0 binds."""
    from dflash_dist.actors import rendezvous

    host = socket.gethostname()  # this machine resolves its own name to loopback
    assert is_loopback(rendezvous.resolve(host))
    assert rendezvous.master_dial_address(host) == network_address(host) == rendezvous.master_bind_address(host)
    assert rendezvous.master_dial_address("127.0.0.1") == "127.0.0.1"
    monkeypatch.setattr(rendezvous, "resolve", lambda name: "2001:db8::7" if name == "gpu-a.cluster" else "?")
    assert rendezvous.master_dial_address("gpu-a.cluster") == "gpu-a.cluster"  # as given: every address tried
    with pytest.raises(OSError, match=r"MASTER_ADDR no-such-host\.invalid does not resolve on"):
        monkeypatch.undo()
        rendezvous.master_dial_address("no-such-host.invalid")


def test_a_multi_node_group_listens_on_the_nodes_network_interface(tmp_path):
    """Two ranks joined as a multi-node Slurm job joins them (MASTER_ADDR the first host's name, which
    this machine resolves to loopback): rank 1 reaches the store at the node's network address (it
    dialled the loopback address its /etc/hosts gives the name, where nothing listens, until the
    store's timeout: every rank beside rank 0 on the first node), and rank 0's gloo listeners are on
    the interface of that address, named in its GLOO_SOCKET_IFNAME, not on loopback."""
    host = socket.gethostname()
    port, sockets, ifname = run_group(tmp_path, host)
    assert (network_address(host), port) in sockets, sockets
    assert ifname == interface_of(network_address(host)) != "lo", ifname
    assert len(sockets) >= 2 and not any(is_loopback(h) for h, _ in sockets), f"on loopback: {sockets}"


def _listening_after_connect(rank: int, world: int) -> list:
    import torch.distributed as dist

    dist.barrier()  # every gloo pair is connected
    found = listening_sockets(os.getpid()) if rank == 0 else []
    dist.barrier()
    return found


def test_local_ranks_listen_on_loopback_only():
    """local_ranks.run_ranks (the 2- and 3-rank DeepSpeed checks and bench/measure_comm.py): its ranks
    join through join_group too, so rank 0 listens on 127.0.0.1 only (they used to join through
    deepspeed.init_distributed, torch's env:// store on every interface)."""
    from dflash_dist.actors.local_ranks import run_ranks

    sockets = run_ranks(_listening_after_connect, 2)[0]
    assert len(sockets) >= 2, sockets  # the store and gloo's listener(s)
    assert all(host == "127.0.0.1" for host, _ in sockets), f"listening beyond loopback: {sockets}"


if __name__ == "__main__":
    rank_main(*sys.argv[1:])


def test_a_rank_builds_deepspeed_ops_with_its_environments_ninja(monkeypatch):
    """run_rank puts the interpreter's bin first on PATH (as an activated venv does): the venv's
    ninja builds DeepSpeed's JIT ops whether the rank came from Ray or srun, so the build log one
    launcher wrote is up to date for the other (a system ninja of another version rebuilt them)."""
    from dflash_dist.actors.trainer_group import interpreter_bin_first

    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/local/bin", "/usr/bin", bin_dir, "/bin"]))
    interpreter_bin_first()
    assert os.environ["PATH"].split(os.pathsep) == [bin_dir, "/usr/local/bin", "/usr/bin", "/bin"]
    interpreter_bin_first()  # idempotent: nothing added twice
    assert os.environ["PATH"].split(os.pathsep) == [bin_dir, "/usr/local/bin", "/usr/bin", "/bin"]
