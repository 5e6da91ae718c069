"""Why the shard group could not start: raised by the executors (:mod:`router.executors`)
and by Ray's placement (:mod:`router.ray_placement`), caught by the launcher and the
``shardserve`` command, which log the message and exit."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The shard group could not be started (a rank exited, resources are missing)."""


class PlacementError(StartupError):
    """The shard group's placement group cannot be placed (resources missing)."""
