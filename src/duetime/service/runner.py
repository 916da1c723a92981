"""A gateway with its embedded emulated instances, started and stopped in order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import replace

from duetime.emulator import Emulator, create_app
from duetime.emulator.options import EmulatorOptions
from duetime.engine.profiles import load_profile
from duetime.gateway.app import Gateway
from duetime.gateway.changes import InstanceChanges, check_live
from duetime.gateway.config import Pool
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.membership import Change
from duetime.service.demo import demo_routes
from duetime.service.pool import embedded_options
from duetime.web.server import AppServer, bind

log = logging.getLogger("duetime.gateway")


class Service:
    """``start``: bind the gateway's port, start the pool's emulated instances on loopback
    ephemeral ports, then the gateway. ``stop``: the gateway first (it stops accepting and
    drains in-flight streams), then the instances it streamed from.

    Each embedded emulator gets a random admin token (``admin_tokens``, by instance name): its
    control routes (``/emulator/faults``, ``/emulator/speed``) answer only to this service,
    not to whoever reads its URL."""

    def __init__(self, pool: Pool, *, host: str = "127.0.0.1", port: int = 0,
                 drain_timeout_s: float | None = None) -> None:
        """Raises :class:`~duetime.gateway.ConfigError` if an ``emulate:`` block is not valid
        emulator options."""
        self.pool = pool
        self.options = embedded_options(pool)
        self.host = host
        self.port = port
        self.drain_timeout_s = drain_timeout_s
        self.emulators: dict[str, Emulator] = {}
        self.emulator_servers: dict[str, AppServer] = {}
        self.admin_tokens: dict[str, str] = {}
        self.gateway: Gateway | None = None
        self.server: AppServer | None = None
        self._stopping: set[asyncio.Task[None]] = set()  # emulators of instances that left

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    async def start(self) -> Service:
        sock = bind(self.host, self.port)
        try:
            await self.start_instances()
            self.gateway = Gateway(self.pool, host=self.host)
            # the SFS demo's page and routes (/duetime/* needs an admin key where there are)
            routes = self.gateway.auth.protect(demo_routes(self.pool))
            app = self.gateway.app(routes=routes)
            self.server = server = AppServer(app, host=self.host, sock=sock,
                                             graceful_timeout_s=self.drain_timeout_s,
                                             limits=self.pool.limits, on_stop=self.gateway.drain)
            # (what the gateway's loop holds of completions: not the admin routes' streams)
            self.gateway.load.count_intake(
                lambda: server.requests_in_progress() - app.others_in_progress)
            await self.server.start()
        except BaseException:
            sock.close()
            await self._stop_emulators(force=True)
            raise
        return self

    async def start_instances(self) -> Pool:
        """Start the pool's emulated instances on loopback and fill in their URLs (the pool
        with them is ``self.pool``, returned; ``duetime epp`` starts only these). On failure
        the caller stops what started (:meth:`stop`)."""
        self.pool = await self._started(self.pool, self.options)
        return self.pool

    async def _started(self, pool: Pool, options: dict[str, EmulatorOptions]) -> Pool:
        """``pool`` with its emulated instances' URLs: those running already keep theirs,
        the others are started."""
        urls = {}
        for inst in pool.instances:
            opts = options.get(inst.name)
            if opts is None:
                continue
            if inst.name in self.emulator_servers:
                urls[inst.name] = self.emulator_servers[inst.name].url
                continue
            # the profile's own timing (the emulator applies its speed) with the
            # instance's limits (its ``config:`` overrides included) and API server (its
            # ``frontend:``, in wall seconds: not scaled by the speed)
            profile = load_profile(inst.profile)  # type: ignore[arg-type]
            emu = opts.emulator(replace(profile, config=inst.config, frontend=inst.frontend),
                                inst.served_model, adapters=inst.adapters)
            token = secrets.token_urlsafe(32)
            server = await AppServer(create_app(emu, admin_token=token), host="127.0.0.1",
                                     port=0).start()
            self.admin_tokens[inst.name] = token
            self.emulators[inst.name] = emu
            self.emulator_servers[inst.name] = server
            urls[inst.name] = server.url
        return pool.with_urls(urls)

    async def reload(self, pool: Pool, gateway: Gateway) -> InstanceChanges:
        """Apply a new config of the pool to the running ``gateway`` (:meth:`Gateway.apply`),
        starting the new emulated instances first; an emulator whose instance left is stopped
        then (:meth:`_on_change`). Raises ConfigError, having changed nothing the gateway
        serves, if the new config cannot apply while serving."""
        check_live(self.pool, pool)
        options = embedded_options(pool)
        started = await self._started(pool, options)
        if self._on_change not in gateway.membership.listeners:
            gateway.membership.listeners.append(self._on_change)
        changes = gateway.apply(started)
        self.pool, self.options = started, options
        return changes

    def _on_change(self, c: Change, s: InstanceState) -> None:
        """An embedded instance that left the pool is stopped (its requests ended)."""
        if c.change != "leave" or s.name in self.options:
            return
        server = self.emulator_servers.pop(s.name, None)
        emu = self.emulators.pop(s.name, None)
        self.admin_tokens.pop(s.name, None)
        if server is not None:
            task = asyncio.get_running_loop().create_task(self._stop_one(server, emu))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    @staticmethod
    async def _stop_one(server: AppServer, emu: Emulator | None) -> None:
        await server.stop(force=True)
        if emu is not None:
            await emu.close()

    async def stop(self, *, force: bool = False) -> int:
        """Returns how many requests were cut at the drain timeout (told so with an error)."""
        cut = 0
        if self.server is not None:
            cut = await self.server.stop(force=force)
            self.server = None
        if self.gateway is not None:
            await self.gateway.close()  # (a forced stop skips the app's shutdown)
        await self._stop_emulators(force=force)
        return cut

    def force(self) -> None:
        if self.server is not None:
            self.server.force()
        for s in self.emulator_servers.values():
            s.force()

    async def _stop_emulators(self, *, force: bool) -> None:
        for task in list(self._stopping):
            with contextlib.suppress(Exception):
                await task
        for server in self.emulator_servers.values():
            await server.stop(force=force)
        for emu in self.emulators.values():
            await emu.close()
        self.emulator_servers.clear()
