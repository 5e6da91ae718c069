"""The public gRPC services as Ray Serve's gRPC proxy registers them
(``grpc_servicer_functions``, :data:`router.serve.app.GRPC_SERVICERS`).

Ray Serve pickles each request message from the proxy to the ingress and each answer
back. ``protoc`` names the generated classes' module ``generate_pb2`` (the file's
name, not its package path), which no other process can import; importing this module
gives them their real module, ``router.pb.generate_pb2``, so pickles name a module
that every process can import. The proxy imports it through the servicer function,
the ingress through :mod:`router.serve.ingress`.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor

from router.pb import generate_pb2, generate_pb2_grpc


def _set_module(descriptor: Descriptor, owner: Any, module: str) -> None:
    cls = getattr(owner, descriptor.name)
    cls.__module__ = module
    for nested in descriptor.nested_types:
        _set_module(nested, cls, module)


for _descriptor in generate_pb2.DESCRIPTOR.message_types_by_name.values():
    _set_module(_descriptor, generate_pb2, generate_pb2.__name__)


def add_text_generation(servicer: Any, server: Any) -> None:
    """Register ``shardserve.generate.v1.TextGeneration`` on ``server`` (what
    ``generate_pb2_grpc.add_TextGenerationServicer_to_server`` does)."""
    generate_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
