"""Backends discovered from DNS: ``dns+http://NAME:PORT`` is every address NAME resolves to.

A Kubernetes headless Service answers with one address per ready pod, so pods that come and
go join and leave the router's pools without a restart:

- every ``discovery_interval`` seconds each name is resolved again;
- an address that appears becomes a backend (``http://ADDRESS:PORT``; a decode's control
  endpoint on the same address, at the control URL's port) and is health-checked like any;
- an address that is gone leaves its pool at once: it gets no new turns; requests and
  streams in flight on it finish (they hold the backend itself, not its pool slot).
  Conversations it retained are then unknown to the router and start over on their next turn;
- a resolution that fails (the DNS server is down, the name does not exist) changes nothing:
  an outage of DNS must not empty the pools. Health checks still eject what does not answer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvturn_server.router._config import DNS_PREFIX, DecodeSpec
from kvturn_server.router._log import event
from kvturn_server.router._pool import Backend, Pool, cancel_and_wait

log = logging.getLogger("kvturn.router")

# (name, port) -> the addresses it resolves to now; OSError when it cannot be resolved.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to (IPv4 and IPv6), through the system resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True, slots=True)
class Target:
    """One ``dns+`` entry: a DNS name standing for a set of backends of one role."""

    role: str
    scheme: str
    name: str
    port: int
    control_scheme: str | None = None
    control_port: int | None = None

    @classmethod
    def of(cls, role: str, url: str, control: str | None = None) -> Target:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None  # checked by the config
        c = urlsplit(control) if control is not None else None
        return cls(role, parts.scheme.removeprefix(DNS_PREFIX), parts.hostname, parts.port,
                   None if c is None else c.scheme.removeprefix(DNS_PREFIX),
                   None if c is None else c.port)

    def backend(self, address: str) -> Backend:
        host = f"[{address}]" if ":" in address else address
        control = None if self.control_port is None else \
            f"{self.control_scheme}://{host}:{self.control_port}"
        return Backend(self.role, f"{self.scheme}://{host}:{self.port}", control)


def targets(prefill: Iterable[str], decode: Iterable[DecodeSpec]) -> list[Target]:
    """The ``dns+`` entries of a config's backend lists."""
    found = [Target.of("prefill", url) for url in prefill if url.startswith(DNS_PREFIX)]
    found += [Target.of("decode", d.url, d.control) for d in decode if d.discovered]
    return found


class Discovery:
    """Keeps the pools' discovered members in step with DNS (see the module docstring).

    Args:
        targets: the ``dns+`` entries.
        pools: the pool of each role.
        interval: seconds between two resolutions.
        resolver: name, port -> addresses (tests inject one).
        timeout: seconds one resolution may take.
        on_change: called after a round that added or removed a backend.
    """

    def __init__(self, targets: list[Target], pools: dict[str, Pool], *, interval: float,
                 resolver: Resolver = resolve, timeout: float = 5.0,
                 on_change: Callable[[], None] | None = None) -> None:
        self.targets = targets
        self.pools = pools
        self.interval = interval
        self.resolver = resolver
        self.timeout = timeout
        self.on_change = on_change
        self.rounds = 0
        self._members: dict[Target, dict[str, Backend]] = {t: {} for t in targets}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and self.targets:
            self._task = asyncio.create_task(self._loop(), name="kvturn-discovery")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not end discovery
                log.exception("discovery round failed")

    async def refresh(self) -> None:
        """One round: resolve every name and add or remove what changed."""
        changed = False
        for target in self.targets:
            try:
                async with asyncio.timeout(self.timeout):
                    addresses = await self.resolver(target.name, target.port)
            except (OSError, TimeoutError) as exc:
                event(log, logging.WARNING, "discovery_failed", role=target.role,
                      dns_name=target.name, error=str(exc) or type(exc).__name__,
                      kept=len(self._members[target]))
                continue
            changed |= self._apply(target, addresses)
        self.rounds += 1
        if changed and self.on_change is not None:
            self.on_change()

    def _apply(self, target: Target, addresses: list[str]) -> bool:
        pool = self.pools[target.role]
        current = self._members[target]
        wanted = {b.url: b for b in (target.backend(a) for a in addresses)}
        changed = False
        for url in sorted(set(current) - set(wanted)):
            backend = current.pop(url)
            pool.remove(backend)
            changed = True
            event(log, logging.INFO, "backend_left", role=target.role, dns_name=target.name,
                  backend=url, in_flight=backend.in_flight)
        for url, backend in wanted.items():
            if url in current or pool.by_url(url) is not None:
                continue  # also listed statically: that entry stays in charge
            pool.add(backend)
            current[url] = backend
            changed = True
            event(log, logging.INFO, "backend_joined", role=target.role, dns_name=target.name,
                  backend=url)
        return changed
