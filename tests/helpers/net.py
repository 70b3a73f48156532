"""Loopback ports for tests of TCP endpoints."""

from __future__ import annotations

import random
import socket

import pytest


def free_port_range(n: int, hosts: tuple[str, ...] = ("127.0.0.1",)) -> int:
    """A port P with P..P+n-1 all free on each of ``hosts`` (loopback addresses) right now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for host in hosts:
                for i in range(n):
                    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
                    socks.append(s)
                    s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.fail(f"found no {n} consecutive free ports on {', '.join(hosts)}", pytrace=False)
