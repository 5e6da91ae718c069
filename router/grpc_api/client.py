"""``shardserve client``: one completion from a running server's public gRPC API
(proto/generate.proto, service ``TextGeneration``), written to stdout.

A check of a server from the shell that needs nothing but shardserve, and a short
example of the generated stubs (``router.pb``) in use.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from router.pb import generate_pb2, generate_pb2_grpc

# Defaults in words, for the help of flags that default to none.
DEFAULT_TEXTS = {"max_new_tokens": "the server's, 100"}


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardserve client``."""
    parser.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    parser.add_argument("--address", default="localhost:3001", metavar="ADDRESS",
                        help="the server's public gRPC API, HOST:PORT")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="TOKENS",
                        help="most tokens to generate")
    parser.add_argument("--stream", action="store_true",
                        help="write each token as it comes (GenerateStream)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="the server's --api-key, sent as the metadata authorization: "
                        "Bearer KEY")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="seconds the whole call may take")


def run_client(args: argparse.Namespace) -> int:
    """Ask the server at ``args.address`` to continue ``args.prompt`` (greedy) and write
    the generated text to stdout, a newline after it.

    Returns:
        The exit code: 0, or 1 when the call failed (its gRPC status code and message
        go to stderr: UNAVAILABLE when nothing answers at the address,
        INVALID_ARGUMENT naming the field, UNAUTHENTICATED without the right key).
    """
    request = generate_pb2.GenerateRequest(
        inputs=args.prompt,
        parameters=generate_pb2.Parameters(max_new_tokens=args.max_new_tokens),
    )
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    with grpc.insecure_channel(args.address) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        try:
            if args.stream:
                for message in stub.GenerateStream(request, timeout=args.timeout,
                                                   metadata=metadata):
                    sys.stdout.write(message.token.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
            else:
                reply = stub.Generate(request, timeout=args.timeout, metadata=metadata)
                sys.stdout.write(reply.sequence.generated_text + "\n")
        except grpc.RpcError as error:
            sys.stdout.flush()
            sys.stderr.write(f"shardserve client: {args.address}: {error.code().name}: "
                             f"{error.details()}\n")
            return 1
    return 0
