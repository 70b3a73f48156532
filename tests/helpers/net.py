"""Loopback ports for tests of TCP endpoints."""

from __future__ import annotations

import random
import socket

import pytest


def free_port_range(n: int) -> int:
    """A port P with P..P+n-1 all free on 127.0.0.1 right now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.fail(f"found no {n} consecutive free ports on 127.0.0.1", pytrace=False)
