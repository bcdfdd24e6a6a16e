"""Clients that agent loops use: the token API over all replicas, routed by the global load balancer.

`LLMServerClient.generate(request_id, prompt_ids, sampling_params) -> TokenOutput`: `request_id` is the high-level
session (trajectory) id used for sticky routing; the server gives every call its own engine request id.
`FullyAsyncLLMServerClient` additionally makes aborts for weight syncs invisible (partial rollout, see below).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError

from rollout_adapters.base import TokenOutput


class LLMServerClient:
    def __init__(self, balancer: Any) -> None:
        """`balancer`: handle of the LoadBalancer actor shared by all clients."""
        self.balancer = balancer
        self._servers: dict[str, Any] = {}

    async def _server(self, server_id: str) -> Any:
        if server_id not in self._servers:
            self._servers[server_id] = await self.balancer.handle.remote(server_id)
        return self._servers[server_id]

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        """One call on the session's server. A server that died mid-call is unregistered and the call retried
        once elsewhere (its sessions re-route)."""
        for attempt in range(2):
            server_id = await self.balancer.acquire_id.remote(request_id)
            try:
                server = await self._server(server_id)
                return await server.generate.remote(request_id, prompt_ids, sampling_params)
            except RayActorError:
                self._servers.pop(server_id, None)
                await self.balancer.remove_server.remote(server_id)
                if attempt == 1:
                    raise
            finally:
                self.balancer.release.remote(server_id)
        raise AssertionError("unreachable")

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
