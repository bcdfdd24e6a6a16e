"""Ports for servers a test starts itself (vLLM's NIXL side channels): free now and below the host's ephemeral
range, so no outgoing connection can be given one before the engine binds it (CI once lost a port that way)."""

from __future__ import annotations

import random
import socket


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive ports that are free now, between Ray's worker ports and the ephemeral range."""
    high = _ephemeral_start() - count
    for _ in range(200):
        base = random.randint(20000, high)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports in 20000..{high}")
