"""The Ray executor's actor class, driven in-process: it is built from the ShardConfig
object itself (no argv) and a rank, and serves that configuration."""

from __future__ import annotations

import pickle
from pathlib import Path

from router.shard_client import ShardClient
from shard.actor import ShardActor
from shard.config import ShardConfig


async def test_actor_serves_the_config_object_it_was_given(tiny_model_dir: Path) -> None:
    config = ShardConfig(model_path=str(tiny_model_dir), model_id="from-object", device="cpu",
                         dtype="float32", attention_backend="torch", block_size=32,
                         kv_cache_bytes=2 * 2**20)
    # Ray pickles the actor's arguments: the config must survive that.
    actor = ShardActor(*pickle.loads(pickle.dumps((config, 0))))
    address = await actor.start("127.0.0.1", 0, loopback=True)
    client = ShardClient([address])
    try:
        await client.wait_ready(30)
        info = (await client.info())[0]
        assert (info.model_id, info.block_size, info.rank, info.world_size) == (
            "from-object", 32, 0, 1)
        assert info.device == "cpu" and info.attention_backend == "torch"
    finally:
        await client.close()
        await actor.stop()
