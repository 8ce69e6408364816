"""Where a push may go: an allow list of networks and host names (``serve --push-allow``).

A push subscription's URL comes from whoever can reach the feed server, and the server then
sends requests there, with the subscription's bearer token. Without a limit that makes the
server a proxy into every network it can reach (server-side request forgery). A
:class:`Destinations` list is checked twice: when the subscription is made
(:meth:`Destinations.check`, which resolves the host) and at every connection
(:class:`AllowedResolver`, which keeps only allowed addresses of what DNS answers then, so
a name that resolves elsewhere later is refused too). Redirects are never followed
(:mod:`protocol.push`).
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from .defaults import DEFAULT_PUSH_ALLOW

__all__ = ["DEFAULT_PUSH_ALLOW", "AllowedResolver", "Destinations"]


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Destinations:
    """Allowed networks (CIDR or single addresses) and host names (exact, lower case)."""

    networks: tuple[Network, ...]
    names: frozenset[str]

    @classmethod
    def parse(cls, spec: str) -> Destinations:
        """``HOST|CIDR,…``; raises ValueError naming an entry that is neither."""
        nets: list[Network] = []
        names: set[str] = set()
        for raw in spec.split(","):
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                nets.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            label = entry.rstrip(".")
            if not label or not all(c.isalnum() or c in "-." for c in label):
                raise ValueError(f"--push-allow: {raw.strip()!r} is neither a host name nor a CIDR")
            names.add(label)
        if not nets and not names:
            raise ValueError("--push-allow is empty: name at least one host or network")
        return cls(tuple(nets), frozenset(names))

    def allows_address(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == n.version and ip in n for n in self.networks)

    def allows_name(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def refuses_literal(self, host: str) -> bool:
        """Whether ``host`` is an address (which a connection uses without asking any
        resolver) that neither a listed name nor a listed network allows."""
        return not self.allows_name(host) and _is_address(host) and not self.allows_address(host)

    def check(self, url: str) -> None:
        """Raise ValueError unless ``url``'s host is allowed: a listed name, or a literal or
        resolved address inside a listed network (blocking: it may ask DNS)."""
        host = urllib.parse.urlsplit(url).hostname or ""
        if not host:
            raise ValueError(f"{url!r} names no host")
        if self.allows_name(host):
            return
        addresses: Iterable[str] = [host]
        if not _is_address(host):
            try:
                infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            except OSError as e:
                raise ValueError(f"host {host!r} does not resolve: {e.strerror or e}") from e
            addresses = {str(i[4][0]) for i in infos}
        bad = sorted(a for a in addresses if not self.allows_address(a))
        if bad:
            raise ValueError(
                f"host {host!r} ({', '.join(bad)}) is not an allowed push destination "
                "(tidefeed serve --push-allow HOST|CIDR,…)"
            )


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class AllowedResolver(AbstractResolver):
    """aiohttp's resolver, keeping only addresses the :class:`Destinations` allow (every
    address of an allowed name)."""

    def __init__(self, allow: Destinations) -> None:
        self.allow = allow
        self._inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if self.allow.allows_name(host):
            return found
        kept = [r for r in found if self.allow.allows_address(r["host"])]
        if not kept:
            raise OSError(f"{host} resolves to no allowed push destination (--push-allow)")
        return kept

    async def close(self) -> None:
        await self._inner.close()
