"""Ports for the servers the tests start.

A port picked by binding to port 0 comes from the kernel's ephemeral range (32768–60999 on
Linux), the range every outgoing connection and every other "any free port" bind of the
machine draws from, Ray's processes included: between the pick and the server's own bind,
seconds later, another process may take it. These come from 20000–32767 instead, below
the ephemeral range and above Ray's default worker ports (10002–19999), and never twice
in one test process.
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 20000, 32767
_given: set[int] = set()
_random = random.SystemRandom()


def unused_port(host: str = "127.0.0.1") -> int:
    """A TCP port of 20000–32767 that nothing listens on now and that this process has
    not handed out before; raises RuntimeError after 1000 tries."""
    for _ in range(1000):
        port = _random.randint(_LOW, _HIGH)
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {_LOW}-{_HIGH} on {host}")
