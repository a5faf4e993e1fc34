"""Which network interface (and address) a node's ranks talk on: the one its route to the master uses.

The address the host name resolves to is 127.0.0.1 on many machines, where peers on other hosts
cannot connect. So each node asks the kernel which local address it would use to reach
`--master-addr`; the stage links (links.py) listen on that address, and the interface that owns
it is exported as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for any torch.distributed use.
`GLOO_SOCKET_IFNAME` (`NCCL_SOCKET_IFNAME` for NCCL), then `--dist-ifname`, override that choice.
"""
from __future__ import annotations

import array
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass

from .. import envs

log = logging.getLogger("stagewise.executor")

CHOSEN_VAR = "STAGEWISE_DIST_IFNAME"     # "master_addr=ifname" once a node chose; child processes inherit it
SIOCGIFCONF, SIOCGIFFLAGS, IFF_LOOPBACK = 0x8912, 0x8913, 0x8
IFREQ_BYTES = 40                                 # struct ifreq on 64-bit Linux


@dataclass(frozen=True)
class DistInterface:
    ifname: str
    address: str        # the local address peers reach this node on ("" when the user named the interface)
    source: str         # what chose it: the route, --dist-ifname or GLOO_SOCKET_IFNAME


def master_ip(master_addr: str) -> str:
    """--master-addr (an address or a host name) as an IP address."""
    try:
        return str(socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as exc:
        raise ValueError(f"--master-addr {master_addr!r} does not resolve ({exc.strerror}); "
                         f"pass the master node's IP address.") from None


def route_address(ip: str) -> str:
    """The local address the kernel would send from to reach `ip` (on the master: `ip` itself)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect((ip, 9))          # UDP connect sends nothing; it only picks the route
        except OSError as exc:
            raise ValueError(f"No local network interface can reach --master-addr {ip} ({exc.strerror}); "
                             f"check the address and this host's routes.") from None
        return udp.getsockname()[0]


def ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, address) for every IPv4 address of this host, secondary ones included."""
    size = IFREQ_BYTES * 256
    buf = array.array("B", bytes(size))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("iL", size, buf.buffer_info()[0])
        used = struct.unpack("iL", fcntl.ioctl(s.fileno(), SIOCGIFCONF, request))[0]
    data = buf.tobytes()[:used]
    return [(data[o:o + 16].split(b"\0")[0].decode().split(":")[0], socket.inet_ntoa(data[o + 20:o + 24]))
            for o in range(0, used, IFREQ_BYTES)]


def ipv6_addresses() -> list[tuple[str, str]]:
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [(row[5], str(ipaddress.IPv6Address(bytes.fromhex(row[0])))) for row in rows if len(row) >= 6]


def interface_of(address: str) -> str | None:
    """The interface that owns a local address."""
    want = ipaddress.ip_address(address)
    pairs = ipv6_addresses() if want.version == 6 else ipv4_addresses()
    return next((name for name, addr in pairs if ipaddress.ip_address(addr) == want), None)


def is_loopback_interface(ifname: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("256s", ifname.encode()))
            flags = struct.unpack("H", answer[16:18])[0]
        except OSError:
            return False
    return bool(flags & IFF_LOOPBACK)


def choose_interface(master_addr: str, dist_ifname: str | None = None) -> DistInterface:
    """The interface this node's ranks use, with the reason; refuses one that strands remote peers."""
    ip = master_ip(master_addr)
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        chosen = DistInterface(os.environ["GLOO_SOCKET_IFNAME"], "", "GLOO_SOCKET_IFNAME")
    elif dist_ifname:
        _check_exists(dist_ifname)
        chosen = DistInterface(dist_ifname, "", "--dist-ifname")
    else:
        local = route_address(ip)
        ifname = interface_of(local)
        if ifname is None:
            raise ValueError(f"No local network interface owns {local}, the address this host uses to reach "
                             f"--master-addr {ip}; name one with --dist-ifname.")
        chosen = DistInterface(ifname, local, "the route to --master-addr")
    _check_not_stranded(chosen, ip)
    return chosen


def _check_exists(ifname: str) -> None:
    names = [name for _, name in socket.if_nameindex()]
    if ifname not in names:
        raise ValueError(f"--dist-ifname {ifname!r} is not a network interface of this host "
                         f"(it has: {', '.join(names)}).")


def _check_not_stranded(chosen: DistInterface, ip: str) -> None:
    """A rank on a loopback interface advertises 127.x; a peer on another host cannot connect there."""
    if ipaddress.ip_address(ip).is_loopback:
        return
    loopbacks = [n for n in chosen.ifname.split(",") if is_loopback_interface(n)]
    if loopbacks:
        raise ValueError(f"The distributed interface {loopbacks[0]} (from {chosen.source}) is loopback, so this "
                         f"node would advertise a 127.x address that hosts on --master-addr {ip}'s network cannot "
                         f"reach; name a routable interface with --dist-ifname.")


def use_interface(master_addr: str, dist_ifname: str | None = None) -> str:
    """Choose this node's interface once, export it for gloo/NCCL and child processes; its name."""
    for_addr, _, ours = (envs.STAGEWISE_DIST_IFNAME or "").rpartition("=")
    if ours and os.environ.get("GLOO_SOCKET_IFNAME") == ours:
        if for_addr == master_addr:       # this node's first process chose (and logged) already
            return ours
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):    # our choice for another master
            if os.environ.get(var) == ours:
                del os.environ[var]
    chosen = choose_interface(master_addr, dist_ifname)
    os.environ["GLOO_SOCKET_IFNAME"] = chosen.ifname
    os.environ.setdefault("NCCL_SOCKET_IFNAME", chosen.ifname)
    os.environ[CHOSEN_VAR] = f"{master_addr}={chosen.ifname}"
    if os.environ.get("LOCAL_RANK", "0") == "0":      # under torchrun: once per node
        where = f", address {chosen.address}" if chosen.address else ""
        log.info("distributed traffic uses interface %s%s (chosen by %s)", chosen.ifname, where, chosen.source)
    return chosen.ifname


def link_address(master_addr: str) -> str:
    """The address this node's links listen on: the routed one if it is on the chosen interface,
    else the interface's first address. Call after `use_interface`."""
    local = route_address(master_ip(master_addr))
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if not ifname or interface_of(local) == ifname:
        return local
    family = ipv6_addresses() if ":" in local else ipv4_addresses()
    return next((a for n, a in family if n == ifname), local)
