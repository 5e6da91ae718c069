"""Model families: :mod:`~shard.models.config` (config.json parsing, no torch),
:mod:`~shard.models.base` (the :class:`~shard.models.base.CausalLM` protocol),
:mod:`~shard.models.registry` (architecture name → class) and one module per family.

NOTE: this package imports nothing itself, so the KV cache and rotary layers can import
:mod:`shard.models.config` without pulling in the models that use them.
"""
