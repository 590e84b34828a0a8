"""Client-side balancing over several servers: least outstanding requests, sticky per route key.

Every sample of one GRPO group shares its prompt, so sending the whole group to one server
computes the prefix once and serves the rest from its cache. A key is bound on first sight to
the least-loaded healthy server and remembered in a bounded LRU; it moves only when its server
fails. Keys without a binding and requests without a key go to the least-loaded server.

A server is avoided in two ways. ``mark_down`` (its requests failed every retry) avoids it for
``down_for`` seconds, yet still picks it when nothing else is left: a brief outage seen by
other requests must not fail this one without a try. ``hold`` (its circuit breaker is open:
its health probe failed, consumers/fleet.py) never picks it until ``release``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence


class StickyBalancer:
    """Picks a server URL per request; the caller brackets each request with ``started`` and
    ``finished`` so outstanding counts stay exact."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        max_keys: int = 100_000,
        down_for: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("give at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"server URLs must be distinct, got {list(urls)}")
        self.urls = list(urls)
        self.max_keys = max_keys
        self.down_for = down_for
        self._clock = clock
        self.outstanding = dict.fromkeys(self.urls, 0)
        self.dispatched = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._held: set[str] = set()
        self._bindings: OrderedDict[str, str] = OrderedDict()

    def is_up(self, url: str) -> bool:
        return url not in self._held and self._clock() >= self._down_until[url]

    def is_held(self, url: str) -> bool:
        return url in self._held

    def hold(self, url: str) -> None:
        """Never choose ``url`` until ``release`` (its breaker is open)."""
        self._held.add(url)

    def release(self, url: str) -> None:
        """``url`` answers again: choose it as before (and forget a ``mark_down``)."""
        self._held.discard(url)
        self._down_until[url] = 0.0

    def mark_down(self, url: str) -> None:
        """Avoid ``url`` for ``down_for`` seconds (it failed every retry)."""
        self._down_until[url] = self._clock() + self.down_for

    def mark_up(self, url: str) -> None:
        self._down_until[url] = 0.0

    def bound(self, route_key: str) -> str | None:
        """The server a key is pinned to, if any (does not refresh the LRU)."""
        return self._bindings.get(route_key)

    def choose(self, route_key: str = "", exclude: Collection[str] = ()) -> str | None:
        """The server for this request, or None when every server is excluded or held.

        A server marked down is still chosen when nothing else is left (a held one never is).
        """
        if route_key:
            url = self._bindings.get(route_key)
            if url is not None and url not in exclude and self.is_up(url):
                self._bindings.move_to_end(route_key)
                return url
        candidates = [u for u in self.urls if u not in exclude and u not in self._held]
        if not candidates:
            return None
        healthy = [u for u in candidates if self.is_up(u)] or candidates
        # Ties (common when requests are short) go to the server that has had fewer requests,
        # then to list order, so keys spread instead of piling onto the first URL.
        url = min(healthy, key=lambda u: (self.outstanding[u], self.dispatched[u]))
        if route_key:
            self._bindings[route_key] = url
            self._bindings.move_to_end(route_key)
            while len(self._bindings) > self.max_keys:
                self._bindings.popitem(last=False)
        return url

    def started(self, url: str) -> None:
        self.outstanding[url] += 1
        self.dispatched[url] += 1

    def finished(self, url: str) -> None:
        self.outstanding[url] -= 1

    def __repr__(self) -> str:
        load = ", ".join(
            f"{u}: {self.outstanding[u]} out/{self.dispatched[u]} sent"
            + (" (held)" if u in self._held else "" if self.is_up(u) else " (down)")
            for u in self.urls
        )
        return f"StickyBalancer({load}; {len(self._bindings)} keys)"
