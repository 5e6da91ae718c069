"""The engine: the continuous-batching loop (:mod:`router.engine.loop`), what the APIs
see of it (:mod:`router.engine.api`), and its link to API processes
(:mod:`router.engine.client` in an API process, :mod:`router.engine.server` in the
engine's, over :mod:`router.engine.ipc`)."""
