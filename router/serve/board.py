"""Where the replicas post what ``/metrics`` shows: a small Ray actor (one per Serve
application) that each replica writes its Prometheus exposition to every
``PUBLISH_EVERY_S`` seconds, and that the ingress reads to answer ``/metrics`` with
every live replica's series, each labelled ``replica="<id>"`` (Serve's replica id).

A replica that stops cleanly removes its entry; one that dies is dropped once its last
post is older than ``STALE_AFTER_S``. So a scrape sees values at most one period old.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

# Seconds between two posts of a replica.
PUBLISH_EVERY_S = 0.5
# Seconds after which a replica that stopped posting is left out.
STALE_AFTER_S = 5.0
# The label every replica's series gets.
REPLICA_LABEL = "replica"


class ReplicaBoard:
    """The replicas' latest posts (a Ray actor; every method is called remotely)."""

    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, bytes]] = {}

    def publish(self, replica: str, metrics: bytes) -> None:
        """Keep ``replica``'s exposition ``metrics`` (Prometheus text, bytes)."""
        self._posts[replica] = (time.monotonic(), metrics)

    def remove(self, replica: str) -> None:
        """Forget ``replica`` (it stopped)."""
        self._posts.pop(replica, None)

    def read(self) -> dict[str, bytes]:
        """Replica id → its latest exposition, for replicas that posted within
        ``STALE_AFTER_S`` seconds (older ones are dropped)."""
        now = time.monotonic()
        for replica in [r for r, (at, _) in self._posts.items() if now - at > STALE_AFTER_S]:
            del self._posts[replica]
        return {replica: metrics for replica, (_, metrics) in self._posts.items()}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?( .*)$")


def merge_expositions(by_replica: Mapping[str, bytes], extra: bytes = b"") -> bytes:
    """One Prometheus text exposition of several replicas' ones: each metric family
    once (its ``# HELP`` / ``# TYPE`` lines), holding every replica's samples with a
    ``replica`` label, in the order the families first appear; ``extra`` (the
    ingress's own families) is appended as it is.

    Raises:
        ValueError: a sample line does not parse (not a text exposition).
    """
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in sorted(by_replica.items()):
        family = ""
        for line in text.decode().splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    lines = headers.setdefault(family, [])
                    if len(lines) < 2 and line not in lines:
                        lines.append(line)
                    samples.setdefault(family, [])
                continue
            match = _SAMPLE.match(line)
            if match is None:
                raise ValueError(f"not a sample line: {line!r}")
            name, labels, rest = match.groups()
            inner = f'{REPLICA_LABEL}="{replica}"' + (
                "," + labels[1:-1] if labels and labels != "{}" else ""
            )
            samples.setdefault(family or name, []).append(f"{name}{{{inner}}}{rest}")
    out = []
    for family, lines in samples.items():
        out += headers.get(family, [])
        out += lines
    return ("\n".join(out) + "\n").encode() + extra if out else extra
