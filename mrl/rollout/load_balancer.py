"""Global request load balancer: least in-flight requests, sticky by high-level request id, elastic server set.

One instance runs as a Ray actor (`ray.remote(LoadBalancer)`, created by LLMServerManager): the registry of
servers and the pool-wide record of calls in flight and sessions, which every client in every agent-loop process
reports to. It is plain Python so its rules are unit-tested without Ray, and clients route with a local instance.

Rules, in order:
1. A request id seen before goes back to the server it went to (multi-turn sessions reuse that server's prefix
   cache), as long as that server is still registered.
2. Otherwise the server with the fewest in-flight requests wins; ties go to the server registered first.
3. Removing a server drops its sticky sessions, so their next turn is routed by rule 2.

Clients route locally with the same rules (a LoadBalancer of their own over the registered servers, counting
their own calls) and report their decisions here, so that this actor's in-flight counts and sessions stay the
pool-wide record (`report`); a membership epoch tells clients when to fetch the server set again (`view`).

It also records the newest weights pushed to the pool (version and what re-syncs a restarted replica). Being the
one actor every copy of the manager talks to, it makes "push to the registered servers" and "register a re-synced
server" atomic with respect to each other (`record_weights`, `add_server_at`): a replica never serves old weights.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class NoServerError(RuntimeError):
    """No server is registered (e.g. every replica failed and is restarting); clients wait and retry."""


class LoadBalancer:
    def __init__(self, servers: dict[str, Any] | None = None, max_sessions: int = 1 << 20) -> None:
        self._servers: dict[str, Any] = {}
        self._in_flight: dict[str, int] = {}
        # Most recently used last; the oldest sessions are forgotten beyond max_sessions to bound memory.
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions
        self._weights_version: int | None = None
        self._weights: Any = None
        # Healthy replacements that cannot be re-synced from a recorded copy (a transport sent the weights): they
        # receive the next push, then register, but serve no request before.
        self._pending: dict[str, Any] = {}
        self._epoch = 0  # bumped by every change of the registered servers
        for server_id, handle in (servers or {}).items():
            self.add_server(server_id, handle)

    def add_server(self, server_id: str, handle: Any = None) -> None:
        if server_id in self._servers:
            raise ValueError(f"server {server_id!r} is already registered")
        self._servers[server_id] = handle
        self._in_flight[server_id] = 0
        self._epoch += 1

    def add_server_at(self, server_id: str, handle: Any, version: int) -> bool:
        """Register a (re)started server that holds weights `version`, unless newer weights were recorded since
        (False: re-sync it and try again). A server registered here receives every later `record_weights` push."""
        if self._weights_version is not None and version != self._weights_version:
            return False
        self._pending.pop(server_id, None)
        if server_id not in self._servers:
            self.add_server(server_id, handle)
        return True

    def add_pending(self, server_id: str, handle: Any) -> None:
        """A server that needs the next push before it may serve (no re-pushable copy of the weights is recorded)."""
        if server_id not in self._servers:
            self._pending[server_id] = handle

    def record_weights(self, version: int, weights: Any) -> dict[str, Any]:
        """Remember the newest weights (`weights`: what `RolloutReplica.update_weights` takes, e.g. the packed
        buckets' object refs, or None when they cannot be re-pushed) and return the servers the caller must push
        them to: the registered ones and the pending ones."""
        self._weights_version, self._weights = int(version), weights
        return {**self._servers, **self._pending}

    def latest_weights(self) -> tuple[int | None, Any]:
        return self._weights_version, self._weights

    def remove_server(self, server_id: str) -> list[str]:
        """Unregister a server; returns the sessions that were stuck to it (they will be re-routed)."""
        self._pending.pop(server_id, None)
        if server_id not in self._servers:
            return []
        del self._servers[server_id]
        del self._in_flight[server_id]
        self._epoch += 1
        orphans = [rid for rid, sid in self._sticky.items() if sid == server_id]
        for rid in orphans:
            del self._sticky[rid]
        return orphans

    def acquire(self, request_id: str) -> tuple[str, Any]:
        """Pick the server for one call of `request_id`, count it in flight until `release`; (server id, handle)."""
        server_id = self.acquire_id(request_id)
        return server_id, self._servers[server_id]

    def acquire_id(self, request_id: str) -> str:
        """`acquire` without the handle."""
        if not self._servers:
            raise NoServerError("no rollout server is registered with the load balancer")
        server_id = self._sticky.get(request_id)
        if server_id is None:
            server_id = min(self._in_flight, key=self._in_flight.__getitem__)
        self._stick(request_id, server_id)
        self._in_flight[server_id] += 1
        return server_id

    def _stick(self, request_id: str, server_id: str) -> None:
        self._sticky[request_id] = server_id
        self._sticky.move_to_end(request_id)
        while len(self._sticky) > self._max_sessions:
            self._sticky.popitem(last=False)

    def report(self, acquired: list[tuple[str, str]], released: list[str]) -> int:
        """A client's routing decisions since its last report: calls started ((request id, server id): counted in
        flight, the session now sticks there) and finished (server ids). Returns the membership epoch, so the
        client sees in the reply whether its server set is stale."""
        for request_id, server_id in acquired:
            if server_id in self._in_flight:  # removed since the client decided: its release is ignored too
                self._in_flight[server_id] += 1
                self._stick(request_id, server_id)
        self.release_ids(released)
        return self._epoch

    def view(self) -> tuple[int, dict[str, Any]]:
        """The registered servers (id -> handle, in registration order) and the epoch they belong to."""
        return self._epoch, dict(self._servers)

    def handle(self, server_id: str) -> Any:
        return self._servers.get(server_id)

    def release(self, server_id: str) -> None:
        if server_id in self._in_flight:  # the server may have been removed while the request ran
            # Floor at 0: a call that started before its server was removed and re-registered ends after it.
            self._in_flight[server_id] = max(self._in_flight[server_id] - 1, 0)

    def release_ids(self, server_ids: list[str]) -> None:
        """`release` for several finished calls in one RPC (clients coalesce the releases of one loop tick)."""
        for server_id in server_ids:
            self.release(server_id)

    def forget(self, request_id: str) -> None:
        """End a session: its next call (if any) is routed as new."""
        self._sticky.pop(request_id, None)

    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def session_server(self, request_id: str) -> str | None:
        return self._sticky.get(request_id)

    def servers(self) -> list[str]:
        return list(self._servers)

    def handles(self) -> dict[str, Any]:
        return dict(self._servers)
