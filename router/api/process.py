"""API processes beside the engine process (``--api-server-count N``).

With ``N`` ≥ 1 the launcher's process keeps the engine (scheduler, block manager, shard
calls, detokenization, stop checks, metrics) and starts ``N`` API processes, each
serving the HTTP and public gRPC APIs over an :class:`~router.engine.client.EngineClient`.
The HTTP port is bound once by the engine process and its socket is shared (the kernel
spreads connections over the processes); each process binds the gRPC port with
``SO_REUSEPORT``. So the HTTP layer's work (parsing, validation, tokenization, one SSE
write per token per stream) runs beside the engine loop instead of between its steps:
with one process, 256 streams cost more CPU per step than a GPU's decode step lasts
(``benchmarks/results/router-step-cpu.md``), and the GPU waited for it.

Lifetimes: SIGTERM or SIGINT to the launcher drains the engine and passes SIGTERM on to
the API processes, which drain their servers (``--graceful-timeout``) and exit; the
launcher then stops the engine and the shards. An API process that exits on its own
stops the server (exit code 1); one that loses the engine process (its socket closes)
fails its open requests and exits.

    python -m router.api.process IPC_FD HTTP_FD   (started by :class:`ApiProcesses`)
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from loguru import logger

from router.api.server import ApiServers, ModelFacts, listen_http, make_state
from router.config import ServerConfig
from router.engine.client import EngineClient
from router.engine.ipc import BudgetsUpdate, read_message, send
from router.engine.loop import Engine
from router.engine.server import ApiConnection, budgets_of
from router.executors import StartupError
from router.log import setup_logging
from router.tokenizer import Tokenizer

# Seconds an API process may take to start (imports, tokenizer, grammar compiler).
START_TIMEOUT_S = 120.0
# Seconds past --graceful-timeout after which an API process still draining is killed.
EXIT_MARGIN_S = 5.0


@dataclass(frozen=True)
class ApiProcessSetup:
    """The first message an API process reads: what it serves and how.

    Attributes:
        config: The server's flags.
        facts: What the shards reported.
        budgets: The budgets in force now.
        index: Which of the API processes this is (0-based), for the log.
        count: How many there are.
    """

    config: ServerConfig
    facts: ModelFacts
    budgets: BudgetsUpdate
    index: int
    count: int


class ApiProcesses:
    """Starts, watches and stops the API processes of ``engine``.

    Args:
        engine: The engine they submit to.
        config: The server's flags.
        facts: What the shards reported.
        count: How many to start.
        http_socket: The HTTP socket they share (bound before the shards started);
            None = bind ``config.host:config.port`` in :meth:`start`.
    """

    def __init__(self, engine: Engine, config: ServerConfig, facts: ModelFacts,
                 count: int, http_socket: socket.socket | None = None) -> None:
        self.engine = engine
        self.config = config
        self.facts = facts
        self.count = count
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.failed = False
        # called when an API process exits unasked (default: request_exit); the launcher
        # makes it the drain a SIGTERM starts, so the other processes' requests end
        # with an error that says why instead of a cut connection
        self.on_failure: Callable[[], None] = self.request_exit
        self._http = http_socket
        self._processes: list[asyncio.subprocess.Process] = []
        self._connections: list[asyncio.Future[None]] = []
        self._exiting = False

    async def start(self) -> None:
        """Bind the HTTP port (unless given), start every API process and wait until
        each serves.

        Raises:
            StartupError: the HTTP port cannot be bound.
            StartupError: an API process exited or did not answer during start-up.
        """
        if self._http is None:
            self._http = listen_http(self.config)
        self.http_port = int(self._http.getsockname()[1])
        try:
            await asyncio.gather(*(self._start_one(index) for index in range(self.count)))
        except BaseException:
            self.request_exit()
            await self._reap()
            raise
        finally:
            # each API process holds the socket now: once they have all closed theirs
            # (draining), new connections are refused, as with one process
            self._http.close()

    async def _start_one(self, index: int) -> None:
        assert self._http is not None
        ours, theirs = socket.socketpair()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.api.process", str(theirs.fileno()),
                str(self._http.fileno()), pass_fds=(theirs.fileno(), self._http.fileno()),
            )
        finally:
            theirs.close()
        self._processes.append(process)
        name = f"API process {index} (pid {process.pid})"
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        setup = ApiProcessSetup(self.config, self.facts, budgets_of(self.engine), index,
                                self.count)
        send(writer, ("setup", setup))
        ready = asyncio.ensure_future(read_message(reader))
        exited = asyncio.ensure_future(process.wait())
        await asyncio.wait({ready, exited}, timeout=START_TIMEOUT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if not ready.done() or ready.exception() is not None:
            ready.cancel()
            exited.cancel()
            writer.close()
            raise StartupError(f"{name} did not start (see its log above)")
        exited.cancel()
        kind, grpc_port = ready.result()
        assert kind == "ready", kind
        self.grpc_port = grpc_port  # type: ignore[assignment]
        connection = ApiConnection(self.engine, reader, writer, name)
        serving = asyncio.ensure_future(connection.serve())
        serving.add_done_callback(lambda task: _log_failure(task, f"serving {name}"))
        self._connections.append(serving)
        logger.info("{} serving", name)

    def request_exit(self) -> None:
        """Ask every API process to drain and exit (SIGTERM)."""
        self._exiting = True
        for process in self._processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)

    async def serve(self) -> None:
        """Wait until every API process has exited. One that exits before it was asked
        to makes the others exit too (:attr:`failed` is then set)."""
        waits = [asyncio.ensure_future(process.wait()) for process in self._processes]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not self._exiting:
                process = self._processes[waits.index(next(iter(done)))]
                logger.error("API process (pid {}) exited with code {}; stopping the server",
                             process.pid, process.returncode)
                self.failed = True
                self.on_failure()
        finally:
            await self._reap()

    async def _reap(self) -> None:
        """Wait for the processes (killing those still running past the graceful
        timeout) and their connections."""
        limit = self.config.graceful_timeout_s + EXIT_MARGIN_S
        for process in self._processes:
            try:
                await asyncio.wait_for(process.wait(), timeout=limit)
            except TimeoutError:
                logger.error("API process (pid {}) did not exit; killing it", process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        await asyncio.gather(*self._connections, return_exceptions=True)


async def _serve(ipc_fd: int, http_fd: int) -> int:
    """One API process: read the setup, serve until SIGTERM or until the engine's
    socket closes; the exit code (1 when the engine went away first)."""
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=ipc_fd))
    kind, setup = await read_message(reader)
    assert kind == "setup" and isinstance(setup, ApiProcessSetup), kind
    setup_logging(json_output=setup.config.shard.json_logs)
    config = setup.config
    tokenizer = Tokenizer.from_folder(config.shard.model_path)
    client = EngineClient(reader, writer, tokenizer, setup.budgets)
    state = make_state(client, client.budgets, tokenizer, setup.facts, config)
    servers = ApiServers(state, config, http_socket=socket.socket(fileno=http_fd),
                         grpc_reuse_port=setup.count > 1)
    try:
        await servers.start()
    except StartupError as error:
        logger.error("API process {}: {}", setup.index, error)
        return 1
    loop = asyncio.get_running_loop()
    exiting = False

    def exit_now() -> None:
        nonlocal exiting
        exiting = True
        servers.request_exit()

    loop.add_signal_handler(signal.SIGTERM, exit_now)
    # Ctrl-C reaches the whole process group: the launcher, which drains the engine
    # and then sends SIGTERM here, decides
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    listening = asyncio.ensure_future(client.run())

    def engine_gone(task: asyncio.Future[None]) -> None:
        _log_failure(task, f"API process {setup.index}: reading the engine's messages")
        if not exiting:
            logger.error("API process {}: the engine process went away; exiting", setup.index)
            servers.failed = True
            servers.request_exit()

    listening.add_done_callback(engine_gone)
    send(writer, ("ready", servers.grpc_port))
    try:
        await servers.serve()
    finally:
        client.close()
        listening.remove_done_callback(engine_gone)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(listening, timeout=5.0)
    return 1 if servers.failed else 0


def _log_failure(task: asyncio.Future[None], what: str) -> None:
    """Log the exception ``task`` ended with, if any (no one else awaits it in time)."""
    if not task.cancelled() and task.exception() is not None:
        logger.opt(exception=task.exception()).error("{} failed", what)


def main(argv: list[str] | None = None) -> int:
    """Entry point of an API process: ``IPC_FD HTTP_FD``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m router.api.process IPC_FD HTTP_FD", file=sys.stderr)
        return 2
    return asyncio.run(_serve(int(args[0]), int(args[1])))


if __name__ == "__main__":
    # run as the imported module, whose classes the setup message was pickled with
    from router.api.process import main as module_main

    sys.exit(module_main())
