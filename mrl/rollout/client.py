"""Clients that agent loops use: the token API over all replicas, routed by the load balancer's rules.

`LLMServerClient.generate(request_id, prompt_ids, sampling_params) -> TokenOutput`: `request_id` is the high-level
session (trajectory) id used for sticky routing; the server gives every call its own engine request id.
`FullyAsyncLLMServerClient` additionally makes aborts for weight syncs invisible (partial rollout, see below).

A call whose replica fails (its process died, or its engine reports itself dead) is retried on another replica,
or on the restarted one, up to `FaultPolicy.max_request_retries` times; the failed attempt returned nothing, so
every call completes exactly once. `LLMServerManager` restarts and re-syncs the failed replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from mrl.config.schema import RolloutConfig
from mrl.rollout.load_balancer import LoadBalancer, NoServerError
from rollout_adapters.base import TokenOutput

# The retry, health-check and time-limit knobs are fields of the rollout config section (documented there), so a
# policy is that section: `FaultPolicy(max_request_retries=1)` is a RolloutConfig with every other field default.
FaultPolicy = RolloutConfig

# How often (s) a client reads the membership epoch from its reports' replies: a replica added while a loop runs
# takes up to this long (plus one report) to receive calls from the client.
EPOCH_CHECK_S = 0.1


class ReplicaFailureError(RuntimeError):
    pass


def wait_within(refs: dict[Any, Any], timeout_s: float, call: str, knob: str) -> None:
    """Wait for every ref of `refs` ({who: ObjectRef}); past `timeout_s` raise naming the call, who did not
    answer and the config knob that sets the limit."""
    import ray

    _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [who for who, ref in refs.items() if ref in pending]
        raise TimeoutError(
            f"{call}: {late} did not answer within {timeout_s:g} s ({knob}); {len(refs) - len(late)} of "
            f"{len(refs)} did"
        )


def replica_failed(error: BaseException) -> bool:
    """Whether an error means the replica is gone (retry elsewhere) rather than that the request was bad.

    Ray raises task errors as instances of their cause too, so a backend's dead-engine error (SGLang and
    TensorRT-LLM map theirs to ConnectionError; vLLM raises EngineDeadError) is seen through Ray."""
    if isinstance(error, RayActorError | ConnectionError):
        return True
    cause = error.cause if isinstance(error, RayTaskError) else error
    return isinstance(cause, ConnectionError) or type(cause).__name__ == "EngineDeadError"


@dataclass
class _LoopState:
    """What one event loop's calls share: the server-set fetch that concurrent callers wait on, and the calls
    waiting to go to their server together (server id -> [(call, future)])."""

    synced: bool = False  # the server set was fetched in this loop (membership may change between loops)
    fetch: asyncio.Future | None = None
    calls: dict[str, list[tuple[tuple, asyncio.Future]]] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)  # tasks waiting for replies (the set keeps them alive)

    def keep(self, task: asyncio.Task) -> None:
        """Hold a fire-and-forget task until it ends (the event loop keeps only weak references)."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class LLMServerClient:
    """Routes each call itself, with the balancer's rules over its own calls (least in flight among this client's
    calls, sticky sessions, registration order on ties), so a call makes one round trip, to its server. Routing
    through the balancer actor cost a second, serial one per call or burst (1-token requests: 8.7 ms through mrl
    vs 4 ms direct on 2 cores). The decisions are reported to the balancer actor, coalesced per loop tick and
    without waiting, so it stays the pool-wide record of calls in flight and sessions; each report's reply carries
    the membership epoch, and a change makes the client fetch the server set again. Agent-loop workers each
    balance their own calls, so the pool is balanced within a few calls per worker."""

    def __init__(self, balancer: Any, policy: FaultPolicy | None = None) -> None:
        """`balancer`: handle of the LoadBalancer actor shared by all clients."""
        self.balancer = balancer
        self.policy = policy or FaultPolicy()
        self.replica_failures = 0  # calls that failed with their replica and were retried (or gave up)
        self._routes = LoadBalancer()  # this client's view of the servers, its calls in flight and its sessions
        self._epoch: int | None = None  # the balancer's membership epoch that `_routes` reflects
        # Per event loop (a client may be driven by successive loops, e.g. one asyncio.run per step, or by several
        # threads): the fetches and calls being coalesced, and the tasks doing the round trips.
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()
        # Calls started ((request id, server id)) and finished (server ids) since the last report.
        self._acquired: list[tuple[str, str]] = []
        self._released: list[str] = []
        self._report_loop: asyncio.AbstractEventLoop | None = None
        self._next_check = 0.0  # loop time from which the next report's reply is read for the epoch

    def _state(self, loop: asyncio.AbstractEventLoop) -> _LoopState:
        state = self._loops.get(loop)
        if state is None:
            state = self._loops[loop] = _LoopState()
        return state

    async def _acquire(self, request_id: str) -> str:
        """Route one call: the session's server, else the one with fewest of this client's calls in flight."""
        state = self._state(asyncio.get_running_loop())
        if not state.synced:
            await self._fetch_servers(state)
            state.synced = True
        server_id = self._routes.acquire_id(request_id)
        self._report(acquired=(request_id, server_id))
        return server_id

    async def _fetch_servers(self, state: _LoopState, fresh: bool = False) -> None:
        """Fetch the registered servers (one RPC shared by the loop's concurrent callers; `fresh`: one started now,
        after what the caller changed) and apply them if newer than what the client has."""
        if fresh or state.fetch is None or state.fetch.done():
            state.fetch = asyncio.ensure_future(self.balancer.view.remote())
        epoch, handles = await asyncio.shield(state.fetch)
        if self._epoch is not None and epoch <= self._epoch:
            return
        self._epoch = epoch
        for server_id in self._routes.servers():
            if server_id not in handles:
                self._routes.remove_server(server_id)  # its sessions are routed again on their next call
        known = set(self._routes.servers())
        for server_id, handle in handles.items():
            if server_id not in known:
                self._routes.add_server(server_id, handle)

    def _release(self, server_id: str) -> None:
        self._routes.release(server_id)
        self._report(released=server_id)

    def _report(self, acquired: tuple[str, str] | None = None, released: str | None = None) -> None:
        """Queue a routing decision for the balancer; those of one loop tick (a burst) leave in one RPC, each RPC
        costing the client and the balancer CPU that, on a small host, the engine would otherwise use."""
        loop = asyncio.get_running_loop()
        if loop is not self._report_loop:  # a previous loop ended before its flush ran: send what it left now
            self._flush_reports()
            self._report_loop = loop
        if not self._acquired and not self._released:
            loop.call_soon(self._flush_reports)
        if acquired is not None:
            self._acquired.append(acquired)
        if released is not None:
            self._released.append(released)

    def _flush_reports(self) -> None:
        if not self._acquired and not self._released:
            return
        reply = self.balancer.report.remote(self._acquired, self._released)
        self._acquired, self._released = [], []
        loop = self._report_loop
        # Read the epoch of at most one reply per EPOCH_CHECK_S; the other reports are fire-and-forget (awaiting
        # every reply cost a 1-token call 0.5 ms of client CPU on 2 cores). A failed call refetches at once.
        if loop is not None and loop.is_running() and loop.time() >= self._next_check:
            self._next_check = loop.time() + EPOCH_CHECK_S
            state = self._state(loop)
            state.keep(loop.create_task(self._check_epoch(reply, state)))

    async def _check_epoch(self, reply: Any, state: _LoopState) -> None:
        with contextlib.suppress(Exception):  # a lost reply only delays the refresh to the next report
            epoch = await reply
            if self._epoch is None or epoch > self._epoch:
                await self._fetch_servers(state)

    def _send(self, server_id: str, server: Any, call: tuple) -> asyncio.Future:
        """Queue one `generate` call for `server`; the calls queued in one loop tick (a burst) leave in one
        `generate_many` RPC whose results stream back in groups (server.serve_many)."""
        loop = asyncio.get_running_loop()
        state = self._state(loop)
        future = loop.create_future()
        queue = state.calls.setdefault(server_id, [])
        queue.append((call, future))
        if len(queue) == 1:
            loop.call_soon(self._flush_calls, state, server_id, server)
        return future

    def _flush_calls(self, state: _LoopState, server_id: str, server: Any) -> None:
        batch = [(call, future) for call, future in state.calls.pop(server_id, []) if not future.done()]
        many = getattr(server, "generate_many", None)  # a server without it takes one call per RPC
        groups = [batch] if many is not None and len(batch) > 1 else [[item] for item in batch]
        for group in groups:
            state.keep(asyncio.get_running_loop().create_task(self._deliver(server, group)))

    @staticmethod
    async def _deliver(server: Any, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        """Send `batch` and settle each call's future with its output or error; a failed RPC (the server died)
        fails every call of the batch that has no result yet, and each caller retries on its own."""
        try:
            if len(batch) == 1:
                ((call, future),) = batch
                out = await server.generate.remote(*call)
                if not future.done():
                    future.set_result(out)
                return
            stream = server.generate_many.options(num_returns="streaming").remote([call for call, _ in batch])
            async for ref in stream:
                for index, result in await ref:
                    future = batch[index][1]
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        except Exception as error:
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
        for _, future in batch:
            if not future.done():
                future.set_exception(RuntimeError("the rollout server ended the call without a result"))

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        """One call on the session's server. A server that fails mid-call is unregistered (its sessions re-route)
        and the call retried elsewhere; with no server registered (all restarting) the call waits for one."""
        failures = 0
        waiting_since: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            try:
                server_id = await self._acquire(request_id)
            except NoServerError:
                waiting_since = loop.time() if waiting_since is None else waiting_since
                if loop.time() - waiting_since > self.policy.request_retry_wait_s:
                    raise NoServerError(
                        f"request {request_id!r}: no rollout replica served within "
                        f"rollout.request_retry_wait_s={self.policy.request_retry_wait_s:g} s"
                    ) from None
                await asyncio.sleep(0.25)
                await self._fetch_servers(self._state(loop), fresh=True)
                continue
            try:
                server = self._routes.handle(server_id)
                if server is not None:
                    return await self._send(server_id, server, (request_id, prompt_ids, sampling_params))
            except Exception as error:
                if not replica_failed(error):
                    raise
                failures += 1
                self.replica_failures += 1
                self._routes.remove_server(server_id)
                await self.balancer.remove_server.remote(server_id)
                if failures > self.policy.max_request_retries:
                    raise ReplicaFailureError(
                        f"request {request_id!r}: the replica serving it failed {failures} times "
                        f"(rollout.max_request_retries={self.policy.max_request_retries}); last: {error}"
                    ) from error
                await self._fetch_servers(self._state(loop), fresh=True)  # the restarted replica, if already up
            finally:
                self._release(server_id)

    async def generate_n(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], n: int
    ) -> list[TokenOutput]:
        """`n` samples of one prompt, all on the same server (they share its prefix cache). With a seed s, sample i
        uses seed s + i, so the samples differ yet the group is reproducible."""
        seed = sampling_params.get("seed")
        calls = [
            self.generate(request_id, prompt_ids, {**sampling_params, "seed": None if seed is None else seed + i})
            for i in range(n)
        ]
        return list(await asyncio.gather(*calls))

    async def end_session(self, request_id: str) -> None:
        self._routes.forget(request_id)
        await self.balancer.forget.remote(request_id)


@dataclass
class TrajectoryOutput(TokenOutput):
    """A TokenOutput assembled from spans generated under possibly different weight versions.

    `version` is the newest version that produced a token (max_version); `spans` lists (start, end, version) over
    token_ids; `num_aborts` counts the interruptions that were resumed.
    """

    min_version: int = 0
    max_version: int = 0
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    num_aborts: int = 0


class FullyAsyncLLMServerClient(LLMServerClient):
    """Partial rollout: when a weight sync aborts a request, continue it instead of losing the work.

    On stop_reason "aborted" the tokens produced so far are appended to the prompt, the token budget shrinks by
    their number, and the request is sent again (it waits in the server until generation resumes, so it runs on
    the new weights). The result is the concatenation of the spans, with each span's log-probs from the weights
    that produced it and min/max version over the spans that produced tokens.
    """

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> TrajectoryOutput:
        params = dict(sampling_params)
        remaining = params.get("max_tokens", 256)
        seed = params.get("seed")
        want_logprobs = params.get("logprobs", True)
        ids: list[int] = []
        lps: list[float] = []
        spans: list[tuple[int, int, int]] = []
        aborts = 0
        while True:
            # A new seed per attempt: re-using it would replay the same random stream at a shifted position.
            attempt = {**params, "max_tokens": remaining, "seed": None if seed is None else seed + aborts}
            out = await super().generate(request_id, list(prompt_ids) + ids, attempt)
            if out.token_ids:
                spans.append((len(ids), len(ids) + len(out.token_ids), out.version))
            ids.extend(out.token_ids)
            lps.extend(out.log_probs or [])
            remaining -= len(out.token_ids)
            if out.stop_reason != "aborted":
                reason = out.stop_reason
                break
            aborts += 1
            if remaining <= 0:
                reason = "length"
                break
        versions = [v for _, _, v in spans] or [out.version]
        return TrajectoryOutput(
            token_ids=ids,
            log_probs=lps if want_logprobs else None,
            stop_reason=reason,
            version=max(versions),
            min_version=min(versions),
            max_version=max(versions),
            spans=spans,
            num_aborts=aborts,
        )
