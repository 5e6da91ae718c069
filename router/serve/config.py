"""Flags of ``shardserve serve`` beyond those of ``launch``: how many replicas, how
they scale and how calls are routed to them. Defined as :class:`ServeConfig`'s fields
(each with its :class:`~router.config.Flag`), like the other config dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.config import Flag

# Routing policies of --routing: ours, and two to measure it against.
ROUTING_POLICIES = ("affinity", "round_robin", "least_loaded")
# The request header that names a conversation (OpenAI's ``user`` field does too).
CONVERSATION_HEADER = "x-conversation-id"


def _flag(help: str, **kwargs: object) -> dict[str, Flag]:
    return {"flag": Flag(help, **kwargs)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class ServeConfig:
    """Replicas, autoscaling and routing of ``shardserve serve``.

    Attributes:
        replicas: Replicas started (each: router + ``--num-shard`` ranks).
        min_replicas: Fewest replicas the autoscaler keeps; None = ``replicas``.
        max_replicas: Most replicas the autoscaler starts; None = ``replicas`` (no
            autoscaling when both equal ``replicas``).
        target_ongoing_requests: Ongoing requests per replica the autoscaler aims at.
        upscale_delay_s: Seconds the autoscaler must want more replicas before it adds
            them (Ray Serve's ``upscale_delay_s``).
        downscale_delay_s: Seconds the autoscaler must want fewer replicas before it
            stops some (Ray Serve's ``downscale_delay_s``).
        routing: ``affinity`` (prefix cache and load), ``round_robin``, ``least_loaded``.
        affinity_max_gap: Affinity yields to load: a replica whose ongoing requests
            exceed the least loaded replica's by more than this is not chosen for its
            cached prefix (requests).
        app_name: The Ray Serve application's name.
        rolling_restart: Redeploy these flags over the running application ``app_name``
            (:mod:`router.serve.restart`) instead of starting one.
    """

    replicas: int = field(
        default=2,
        metadata=_flag(
            "replicas to start, each a router with its own shard group of --num-shard ranks",
            type=int,
            metavar="N",
        ),
    )
    min_replicas: int | None = field(
        default=None,
        metadata=_flag(
            "fewest replicas the autoscaler keeps", type=int, metavar="N", default_text="--replicas"
        ),
    )
    max_replicas: int | None = field(
        default=None,
        metadata=_flag(
            "most replicas the autoscaler starts (above --min-replicas: autoscaling on "
            "ongoing requests)",
            type=int,
            metavar="N",
            default_text="--replicas",
        ),
    )
    target_ongoing_requests: float = field(
        default=16.0,
        metadata=_flag(
            "ongoing requests per replica the autoscaler aims at", type=float, metavar="REQUESTS"
        ),
    )
    upscale_delay_s: float = field(
        default=10.0,
        metadata=_flag(
            "seconds the autoscaler must want more replicas before it adds them",
            type=float,
            metavar="SECONDS",
        ),
    )
    downscale_delay_s: float = field(
        default=60.0,
        metadata=_flag(
            "seconds the autoscaler must want fewer replicas before it stops some",
            type=float,
            metavar="SECONDS",
        ),
    )
    routing: str = field(
        default="affinity",
        metadata=_flag(
            "how a request picks its replica: prefix-cache affinity balanced against load, "
            "or round_robin / least_loaded to measure it against",
            choices=ROUTING_POLICIES,
        ),
    )
    affinity_max_gap: int = field(
        default=4,
        metadata=_flag(
            "a replica holding the prompt's prefix is passed over when it has more than this "
            "many ongoing requests above the least loaded replica",
            type=int,
            metavar="REQUESTS",
        ),
    )
    app_name: str = field(
        default="shardserve", metadata=_flag("name of the Ray Serve application", metavar="NAME")
    )
    rolling_restart: bool = field(
        default=False,
        metadata=_flag(
            "instead of starting an application, replace the replicas of the one running "
            "on --ray-address (as --app-name) with these flags, one at a time: each stops "
            "taking calls, finishes its own within its --graceful-timeout, then is replaced",
            type=bool,
        ),
    )

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        low, high = self.scale_bounds
        if low < 1 or high < low:
            raise ValueError(f"--min-replicas ({low}) must be >= 1 and <= --max-replicas ({high})")
        if not low <= self.replicas <= high:
            raise ValueError(
                f"--replicas ({self.replicas}) must lie within --min-replicas "
                f"({low}) and --max-replicas ({high})"
            )
        if self.target_ongoing_requests <= 0:
            raise ValueError("--target-ongoing-requests must be > 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("--upscale-delay and --downscale-delay must be >= 0")
        if self.affinity_max_gap < 0:
            raise ValueError("--affinity-max-gap must be >= 0")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")

    @property
    def scale_bounds(self) -> tuple[int, int]:
        """(min, max) replicas."""
        low = self.replicas if self.min_replicas is None else self.min_replicas
        high = self.replicas if self.max_replicas is None else self.max_replicas
        return low, high

    @property
    def autoscaling(self) -> bool:
        """Whether the replica count may change with load."""
        low, high = self.scale_bounds
        return low != high
