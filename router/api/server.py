"""The API servers of one process: HTTP (uvicorn) and the public gRPC API.

They run in the engine's process (``--api-server-count 0``) or in each API process
(:mod:`router.api.process`), over an :class:`~router.engine.api.EngineApi`.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import grpc
from loguru import logger

from router.api.app import ServerState, create_app
from router.api.http_server import HTTP_BACKLOG, bind_http, make_http_server
from router.config import ServerConfig
from router.engine.api import EngineApi
from router.executors import StartupError
from router.grpc_api.server import start_grpc_server
from router.tokenizer import Tokenizer
from router.validation import Budgets, Validator

# Seconds the HTTP and gRPC servers wait past --graceful-timeout before cutting what is
# still open: the launcher fails the requests still running when the graceful timeout
# ends (router.launcher.ShutdownDeadline), and their answers (a JSON error, an error
# event, gRPC UNAVAILABLE) need a moment to be written.
ANSWER_MARGIN_S = 2


def package_version() -> str:
    """Installed version of shardserve."""
    try:
        return version("shardserve")
    except PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class ModelFacts:
    """What the shards reported at start-up, as ``/info`` and the OpenAI routes show it."""

    model_id: str
    dtype: str
    device_type: str
    num_shard: int
    attention_backend: str
    version: str
    # --quantization, the KV cache's dtype, and both in words (shard.config)
    quantization: str = "none"
    kv_cache_dtype: str = ""
    quantization_details: str = ""
    # speculative decoding in words (router.config.speculation_details); empty when off
    speculative_decoding: str = ""


def make_state(engine: EngineApi, budgets: Budgets, tokenizer: Tokenizer,
               facts: ModelFacts, config: ServerConfig) -> ServerState:
    """The state the APIs serve: ``engine``, a validator reading ``budgets``, the facts
    and the server's flags."""
    validator = Validator(
        tokenizer=tokenizer,
        scheduler=budgets,
        limits=config.limits,
        max_request_bytes=config.max_request_bytes,
    )
    return ServerState(
        engine=engine,
        validator=validator,
        model_id=facts.model_id,
        dtype=facts.dtype,
        device_type=facts.device_type,
        num_shard=facts.num_shard,
        attention_backend=facts.attention_backend,
        version=facts.version,
        quantization=facts.quantization,
        kv_cache_dtype=facts.kv_cache_dtype or facts.dtype,
        quantization_details=facts.quantization_details,
        speculative_decoding=facts.speculative_decoding,
        max_request_bytes=config.max_request_bytes,
        model_aliases=config.served_model_names[1:],
        api_key=config.api_key,
        metrics_require_api_key=config.metrics_require_api_key,
    )


class GrpcDrain:
    """Stops the public gRPC server once: open calls (streams included) get
    ``grace_s`` seconds to finish, new calls are answered UNAVAILABLE meanwhile."""

    def __init__(self, server: grpc.aio.Server | None, grace_s: float) -> None:
        self.server = server
        self.grace_s = grace_s
        self._begun = False
        self._stopping: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Begin the drain (no-op once begun, or without a gRPC server)."""
        self._begun = True
        if self.server is not None and self._stopping is None:
            self._stopping = asyncio.ensure_future(self.server.stop(grace=self.grace_s))

    def begun(self) -> bool:
        """Whether the drain has begun: a call failed from now on was cut by the
        shutdown (the servicer answers UNAVAILABLE, so that the client retries)."""
        return self._begun

    async def wait(self) -> None:
        """Begin the drain if needed and wait until the server has stopped."""
        self.start()
        if self._stopping is not None:
            await self._stopping


class ApiServers:
    """HTTP and public gRPC over ``state`` until asked to exit.

    Args:
        state: What the APIs serve.
        config: Host, ports, timeouts.
        http_socket: A listening socket to serve HTTP on (shared by several API
            processes); None = bind ``config.host:config.port``.
        grpc_reuse_port: Several processes bind the gRPC port (``SO_REUSEPORT``).
    """

    def __init__(self, state: ServerState, config: ServerConfig,
                 http_socket: socket.socket | None = None,
                 grpc_reuse_port: bool = False) -> None:
        self.state = state
        self.config = config
        self.http_socket = http_socket
        self.grpc_reuse_port = grpc_reuse_port
        # past the graceful timeout the requests still running are failed (by the
        # launcher); the servers wait a little longer for those answers
        grace_s = config.graceful_timeout_s + ANSWER_MARGIN_S
        self.http = make_http_server(create_app(state), config.host, config.port,
                                     config.header_timeout_s, grace_s)
        self.grpc_drain = GrpcDrain(None, grace_s)
        self.http_port = config.port
        self.grpc_port: int | None = None
        self.failed = False  # a frontend ended for a reason other than a request to exit

    async def start(self) -> None:
        """Bind the HTTP port (unless given a socket) and start the gRPC server; HTTP
        requests are served from :meth:`serve`.

        Raises:
            StartupError: the HTTP or the gRPC port could not be bound.
        """
        if self.http_socket is None:
            self.http_socket = listen_http(self.config)
            self.http_port = int(self.http_socket.getsockname()[1])
        if self.config.grpc_port:
            try:
                server, self.grpc_port = await start_grpc_server(
                    self.state, self.config.host, self.config.grpc_port, self.grpc_reuse_port,
                    draining=self.grpc_drain.begun)
            except RuntimeError as error:
                self.http_socket.close()
                raise StartupError(
                    f"cannot bind the gRPC port {self.config.host}:{self.config.grpc_port} (in use "
                    "or not an address of this machine; --host, --grpc-port)") from error
            self.grpc_drain.server = server
        # NOTE: start-up objects (tokenizer, app, modules) never become garbage; taking
        # them out of the collector's reach keeps each full collection short (it stops
        # every thread, the event loop included) while large requests allocate.
        gc.collect()
        gc.freeze()

    def request_exit(self) -> None:
        """Stop admission: uvicorn closes its listening socket and the gRPC server
        refuses new calls (UNAVAILABLE); both wait up to ``--graceful-timeout`` for open
        requests (streams included) to finish."""
        self.http.should_exit = True
        self.grpc_drain.start()

    async def serve(self) -> None:
        """Serve until :meth:`request_exit` and the drain are done."""
        try:
            sockets = None if self.http_socket is None else [self.http_socket]
            await self.http.serve(sockets=sockets)
        finally:
            await self.grpc_drain.wait()  # started with the HTTP drain, as long at most


def listen_http(config: ServerConfig) -> socket.socket:
    """The listening socket of the HTTP API on ``--host``/``--port``.

    Raises:
        StartupError: the address cannot be bound (in use, or not this machine's).
    """
    try:
        return bind_http(config.host, config.port)
    except OSError as error:
        raise StartupError(_clash(config.host, config.port, "HTTP", "--port", error)) from error


class ServerPorts:
    """The ports of the APIs, bound before the shard group starts, so that a port in
    use ends ``shardserve launch`` at once instead of after the model has loaded and
    warmed up (minutes on a GPU).

    The HTTP socket is bound to ``--host``/``--port`` and kept: :meth:`listen` hands it
    to the HTTP server (or to the API processes, which share it). It listens only from
    then on, so connections during start-up are refused, as before. grpcio binds its
    ports itself, so ``--grpc-port`` is bound here and given back just before the gRPC
    server binds it (:meth:`listen` again).

    NOTE: both sockets are bound with ``SO_REUSEADDR`` (as uvicorn's and grpcio's
    are), else connections of a previous server still in TIME_WAIT would count as a
    clash; on Linux this lets another server bind the port while ours does not listen
    yet, and that rare clash is reported when ours starts to listen.

    Args:
        config: ``host``, ``port`` and ``grpc_port`` (0 = no gRPC API).

    Raises:
        StartupError: a port cannot be bound (in use, or ``--host`` is not an address of
            this machine); the message names the flag and the address.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.http = _bind(config.host, config.port, "HTTP", "--port")
        self._grpc: socket.socket | None = None
        if config.grpc_port:
            try:
                self._grpc = _bind(config.host, config.grpc_port, "gRPC", "--grpc-port")
            except StartupError:
                self.http.close()
                raise

    def listen(self) -> socket.socket:
        """Listen on the HTTP socket and give the gRPC port back (for the gRPC server
        to bind it now); returns the HTTP socket.

        Raises:
            StartupError: another server took the HTTP port meanwhile.
        """
        if self._grpc is not None:
            self._grpc.close()
        try:
            self.http.listen(HTTP_BACKLOG)
        except OSError as error:
            raise StartupError(_clash(self.config.host, self.config.port, "HTTP", "--port",
                                      error)) from error
        return self.http

    def close(self) -> None:
        """Close both sockets (those already handed over too)."""
        self.http.close()
        if self._grpc is not None:
            self._grpc.close()


def _bind(host: str, port: int, api: str, flag: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening), inheritable by the API
    processes; StartupError naming ``flag`` when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise StartupError(_clash(host, port, api, flag, error)) from error
    sock.set_inheritable(True)
    return sock


def _clash(host: str, port: int, api: str, flag: str, error: OSError) -> str:
    return (f"cannot bind the {api} port {host}:{port}: {error.strerror or error} "
            f"(--host, {flag})")


def log_serving(model_id: str, config: ServerConfig, grpc_port: int | None,
                http_port: int | None = None) -> None:
    """The "serving" lines of the log."""
    if grpc_port:
        logger.info("serving the gRPC API on {}:{}", config.host, grpc_port)
    logger.info("serving {} on http://{}:{}", model_id, config.host, http_port or config.port)
