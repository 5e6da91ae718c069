"""ShardHealth's words for each state, with a clock the test moves."""

from __future__ import annotations

from router.health import GroupState, ShardHealth


def test_the_words_of_each_state() -> None:
    now = [100.0]
    health = ShardHealth(clock=lambda: now[0])
    assert health.problem() is None
    health.not_answering(None, since=99.0)  # several ranks pinged: which one is unknown
    now[0] = 101.5
    health.not_answering(None, since=101.0)  # still not answering: the first time stays
    assert health.problem() == "a model shard is not answering (for 2.5 s)"
    health.restarting("shard rank 1 is hung (a step ran past the step deadline)")
    assert health.problem() == ("the shard group is restarting (shard rank 1 is hung (a step "
                                "ran past the step deadline))")
    health.live()
    assert health.state is GroupState.LIVE and health.problem() is None
    health.down("shard rank 0 died or stopped answering; no restart left")
    assert health.problem() == ("the shard group is down (shard rank 0 died or stopped "
                                "answering; no restart left)")
