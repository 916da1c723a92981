"""Running ASGI apps in-process with uvicorn: several servers on one event loop, ephemeral
ports, clean shutdown on Ctrl-C (used by ``duetime emulate``, ``duetime serve``, the tests
and the benchmarks).

uvicorn's own signal handling is for one server per process; here the caller owns the signals
(:func:`shutdown_signals`) and stops servers in order (the gateway drains its streams before the
instances it streams from go away). Sockets are bound here, so a port in use is a clear error
rather than uvicorn's ``sys.exit``. Every server runs uvicorn's httptools protocol with the
protocol limits of :mod:`duetime.web.protocol`.

The drain timeout is kept here rather than by uvicorn (``timeout_graceful_shutdown``), which
cancels the requests still open with nothing said to their clients and leaves no trace of it:
:meth:`AppServer.stop` cancels them itself, their endpoints
(:class:`~duetime.web.asgi.Disconnect`) end each one with an error (a final SSE error event
on a stream), and it returns how many were cut, so that a command can exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn

from duetime.web.limits import DEFAULT_LIMITS, LimitsSpec
from duetime.web.protocol import NewConnections, protocol_class

T = TypeVar("T")

CUT_GRACE_S = 2.0  # after the drain timeout: time for cut requests to tell their clients


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed (the servers' socket events cost fewer
    µs there), on asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


class ServeError(RuntimeError):
    """A server could not start (e.g. its port is in use)."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the caller handles signals
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (port 0: an ephemeral one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServeError(f"cannot resolve host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class AppServer:
    """One ASGI app served by uvicorn on the running loop."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0,
                 graceful_timeout_s: float | None = None, sock: socket.socket | None = None,
                 limits: LimitsSpec = DEFAULT_LIMITS,
                 on_stop: Callable[[], None] | None = None, **uvicorn_kw: Any) -> None:
        """``sock``: an already bound socket (see :func:`bind`) instead of host and port;
        ``graceful_timeout_s``: the drain timeout of :meth:`stop` (None: no limit);
        ``on_stop``: called when :meth:`stop` begins (the app ends its endless streams)."""
        self.on_stop = on_stop
        self.host = host
        self.sock = sock if sock is not None else bind(host, port)
        self.port = int(self.sock.getsockname()[1])
        self.graceful_timeout_s = graceful_timeout_s
        self.limits = limits
        uvicorn_kw.setdefault("timeout_keep_alive", limits.keep_alive_s)
        self._new = NewConnections()
        self.config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                     http=protocol_class(limits, self._new), **uvicorn_kw)
        self.server = _Server(self.config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def requests_in_progress(self) -> int:
        """Requests this server has not finished answering: those it has read the headers of
        (whether or not their handlers have started: a burst read in one go counts at once),
        and one on each open connection that has not sent one yet."""
        return len(self.server.server_state.tasks) + self._new.count

    async def start(self) -> AppServer:
        self._task = asyncio.get_running_loop().create_task(
            self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():
                exc = self._task.exception()
                raise ServeError(f"server on {self.host}:{self.port} did not start: {exc}")
            await asyncio.sleep(0.002)
        return self

    async def stop(self, *, force: bool = False) -> int:
        """Stop accepting, let in-flight responses finish (unless ``force``) for at most the
        drain timeout, shut down. Returns how many requests were cut at the drain timeout
        (each told so: see :class:`~duetime.web.asgi.Disconnect`)."""
        if self._task is None:
            return 0
        task = self._task
        self.server.should_exit = True
        if self.on_stop is not None:
            self.on_stop()
        if force:
            self.server.force_exit = True
        cut = 0
        try:
            await asyncio.wait_for(asyncio.shield(task), self.graceful_timeout_s)
        except TimeoutError:
            cut = self._cut()
            try:
                await asyncio.wait_for(asyncio.shield(task), CUT_GRACE_S)
            except TimeoutError:  # a client that reads nothing: stop waiting for it
                self.server.force_exit = True
        except asyncio.CancelledError:
            if not task.done():
                raise
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._task = None
        await self._finish_lifespan()
        return cut

    def _cut(self) -> int:
        """Cancel the requests still running (the drain timeout is past)."""
        tasks = [t for t in self.server.server_state.tasks if not t.done()]
        for t in tasks:
            t.cancel(msg="the server's drain timeout is past")
        return len(tasks)

    async def _finish_lifespan(self) -> None:
        """A forced exit skips the app's shutdown; run it (the app's resources close, and
        no lifespan task is left to die noisily when the loop ends)."""
        lifespan = getattr(self.server, "lifespan", None)
        if self.server.force_exit and lifespan is not None and self.server.started \
                and not lifespan.shutdown_event.is_set():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(lifespan.shutdown(), 5.0)

    def force(self) -> None:
        self.server.force_exit = True


@contextlib.contextmanager
def shutdown_signals(on_first: Callable[[], None],
                     on_second: Callable[[], None]) -> Iterator[None]:
    """SIGINT / SIGTERM call ``on_first`` (graceful), a second one ``on_second`` (force)."""
    loop = asyncio.get_running_loop()
    count = 0

    def handler() -> None:
        nonlocal count
        count += 1
        (on_first if count == 1 else on_second)()

    sigs = (signal.SIGINT, signal.SIGTERM)
    installed = []
    for sig in sigs:
        try:
            loop.add_signal_handler(sig, handler)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
