"""Host-name lookups for the OpenAI-compatible judge's session, on the event loop: no thread.

aiohttp's default resolver runs getaddrinfo in the loop's thread pool, and aiodns runs c-ares on
threads of its own; the daemon starts no threads (docs/ARCHITECTURE.md §1). `LoopResolver` asks
the nameservers itself through dnspython's asyncio backend: a datagram endpoint on the loop per
query (TCP after a truncated answer, through asyncio.open_connection to the nameserver's IP, which
asyncio connects without getaddrinfo). A and AAAA are asked at once; the addresses are kept for
the answers' TTL, at most MAX_TTL, for at most MAX_ENTRIES names. `NoLookups` serves URLs that
name an IP literal: they need no nameserver, and a name there is refused instead of looked up in
a thread. Only the judge's session uses these: nothing here changes aiohttp's global default.
"""
from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import time

import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver
from aiohttp.abc import AbstractResolver, ResolveResult

MAX_TTL = 300.0  # seconds: a long TTL still lets a judge that moved be found within minutes
MAX_ENTRIES = 64  # names kept; the judge needs one, a redirect may add a few
LIFETIME = 5.0  # seconds for one lookup, every nameserver and retry included
_TYPES = {socket.AF_INET: (dns.rdatatype.A,), socket.AF_INET6: (dns.rdatatype.AAAA,)}
_FAMILY = {dns.rdatatype.A: socket.AF_INET, dns.rdatatype.AAAA: socket.AF_INET6}


class LookupFailed(OSError):
    """A host name that gave no address. An OSError, so aiohttp reports it as its DNS error
    (ClientConnectorDNSError) with this exception as `os_error`."""

    def __init__(self, host: str, why: str):
        super().__init__(f"{host}: {why}")
        self.strerror = str(self)  # what aiohttp's message shows between brackets
        self.host, self.why = host, why


def _results(host: str, port: int, addresses: list[tuple[int, str]]) -> list[ResolveResult]:
    return [ResolveResult(hostname=host, host=ip, port=port, family=af, proto=socket.IPPROTO_TCP,
                          flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV) for af, ip in addresses]


class NoLookups(AbstractResolver):
    """For a judge addressed by IP literal: aiohttp never asks (it skips IPs); a redirect to a
    name would, and must not reach the default threaded resolver."""

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        raise LookupFailed(host, "not looked up: the judge URL names an IP address, so clawd resolves no names")

    async def close(self) -> None:
        pass


class LoopResolver(AbstractResolver):
    """A and AAAA through dnspython on the running loop, cached per TTL, concurrent asks shared.

    `nameserver` is (ip, port); None reads /etc/resolv.conf (nameservers, search list, ndots,
    timeout) once, here: a small synchronous read at start-up, like the configuration file's."""

    # Replaceable in tests, to expire the cache without waiting.
    clock = staticmethod(time.monotonic)

    def __init__(self, nameserver: tuple[str, int] | None = None):
        if nameserver is None:
            try:
                self._dns = dns.asyncresolver.Resolver()
            except dns.resolver.NoResolverConfiguration as exc:
                raise ValueError(f"no usable /etc/resolv.conf ({exc}): set judge.nameserver") from None
            self._search = True  # as getaddrinfo does: resolv.conf's search list and ndots apply
        else:
            ip, port = nameserver
            self._dns = dns.asyncresolver.Resolver(configure=False)
            self._dns.nameservers = [dns.nameserver.Do53Nameserver(ip, port)]
            self._search = False
        self._dns.lifetime = LIFETIME
        # Named, not sniffed: the asyncio backend is the one without threads.
        self._backend = dns.asyncbackend.get_backend("asyncio")
        self._cache: dict[tuple[str, int], tuple[float, list[tuple[int, str]]]] = {}
        self._pending: dict[tuple[str, int], asyncio.Task] = {}

    @property
    def nameservers(self) -> list[str]:
        return [str(ns) for ns in self._dns.nameservers]

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            return _results(host, port, [(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, host)])
        key = (host.lower(), int(family))
        hit = self._cache.get(key)
        if hit is not None and hit[0] > self.clock():
            return _results(host, port, hit[1])
        task = self._pending.get(key)
        if task is None:
            task = asyncio.create_task(self._lookup(key), name=f"dns lookup {host}")
            self._pending[key] = task
            task.add_done_callback(functools.partial(self._settled, key))
        # Shielded: a caller that gives up (its attempt timed out) must not cancel the lookup others
        # wait on; the lookup itself ends within LIFETIME.
        return _results(host, port, await asyncio.shield(task))

    def _settled(self, key: tuple[str, int], task: asyncio.Task) -> None:
        self._pending.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: a failure nobody waits for any more is not logged as lost

    async def _lookup(self, key: tuple[str, int]) -> list[tuple[int, str]]:
        host, family = key
        types = _TYPES.get(family, (dns.rdatatype.A, dns.rdatatype.AAAA))
        answers = await asyncio.gather(*(self._dns.resolve(host, rdtype, search=self._search,
                                                           raise_on_no_answer=False, backend=self._backend)
                                         for rdtype in types), return_exceptions=True)
        addresses: list[tuple[int, str]] = []
        ttl, errors = MAX_TTL, []
        for rdtype, answer in zip(types, answers):
            if isinstance(answer, dns.exception.DNSException):
                errors.append(answer)
            elif isinstance(answer, BaseException):
                raise answer
            elif answer.rrset:  # an empty answer (no record of this type) carries no TTL we need
                addresses += [(_FAMILY[rdtype], rd.address) for rd in answer.rrset]
                # expiration is wall-clock, the least TTL along any CNAME chain
                ttl = min(ttl, answer.expiration - time.time())
        if not addresses:
            raise LookupFailed(host, _why(errors, types))
        if ttl > 0:  # a TTL of 0 means "do not keep"
            if len(self._cache) >= MAX_ENTRIES:
                self._evict()
            self._cache[key] = (self.clock() + ttl, addresses)
        return addresses

    def _evict(self) -> None:
        now = self.clock()
        for k in [k for k, (expires, _) in self._cache.items() if expires <= now]:
            del self._cache[k]
        while len(self._cache) >= MAX_ENTRIES:
            del self._cache[next(iter(self._cache))]  # the oldest entry

    async def close(self) -> None:
        pending = list(self._pending.values())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._cache.clear()


def _why(errors: list[dns.exception.DNSException], types: tuple) -> str:
    """One line on why a name gave no address."""
    if any(isinstance(e, dns.resolver.NXDOMAIN) for e in errors):
        return "no such name (NXDOMAIN)"
    for e in errors:
        if isinstance(e, dns.resolver.LifetimeTimeout):
            return f"no answer from the nameservers within {LIFETIME:g} s"
    if errors:
        return f"{type(errors[0]).__name__}: {errors[0]}"
    return "no " + " or ".join(dns.rdatatype.to_text(t) for t in types) + " record"
