"""What a set of processes listens on outside loopback: the check behind "local means local"."""
from __future__ import annotations

import ipaddress
from typing import Iterable

import psutil


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:  # ::ffff:127.0.0.1
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listening_off_loopback(procs: Iterable[psutil.Process]) -> list[str]:
    """'name ip:port' for each TCP port these processes listen on anywhere but loopback; a
    wildcard address (0.0.0.0, ::) counts as off loopback."""
    off = []
    for proc in procs:
        try:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and not is_loopback(c.laddr.ip):
                    off.append(f"{proc.name()} {c.laddr.ip}:{c.laddr.port}")
        except psutil.Error:
            pass
    return off
