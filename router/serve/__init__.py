"""Data-parallel replicas on Ray Serve (``shardserve serve``).

Each replica is a whole server (router + its shard group in its own placement group,
:mod:`router.serve.replica`); an ingress deployment (:mod:`router.serve.ingress`)
behind Ray Serve's HTTP and gRPC proxies forwards every call to one replica, chosen by
our request router (:mod:`router.serve.request_router`) by prefix-cache affinity and
load (:mod:`router.serve.affinity`).
"""
