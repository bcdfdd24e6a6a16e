"""Prefill/decode-disaggregated replicas: one prefill server and N decode servers that pass KV caches over a transfer
backend, seen from outside as one replica (one `generate`, one weight version).

Footprint: TP_prefill + TP_decode × N_decode device slots. What backends support (checked at start-up by
`PDSpec.check`): one prefill server, DP 1, PP 1, one node; vLLM with the nixl or mooncake KV connector; SGLang with
its disaggregation mode over mooncake or nixl; TensorRT-LLM and hf have no PD path here.

Routing (`PDRouter.generate`): a request goes to the prefill server and to one decode partner, chosen per session
like the global balancer does (sticky by request id, else least in flight):
- vLLM (KVTransferConfig, as vLLM's disaggregated proxy does): the prefill server runs the prompt with max_tokens 1
  and `do_remote_decode`, and returns `kv_transfer_params`; the decode server gets the same prompt with those params,
  pulls the KV blocks and generates every output token.
- SGLang (its disaggregation mode, as sglang-router does): both servers receive the same request with
  bootstrap_host/port/room; the prefill server pushes the KV to the decode server, whose answer is the sample.
Control calls (weight updates, abort, resume, sleep, wake, cache) reach every member.

The router is plain Python over members with the RolloutServer method names, so it runs in-process over adapters
(tests) or as a Ray actor over member server actors (`PDReplica`).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mrl.rollout.bursts import serve_many
from mrl.rollout.load_balancer import LoadBalancer
from rollout_adapters.base import TokenOutput, normalize_sampling

# Transfer backend name -> vLLM KV connector class name (vllm/distributed/kv_transfer/kv_connector/factory.py).
VLLM_CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
# `--disaggregation-transfer-backend` values of SGLang that move KV between servers (its `fake` is a test stub).
SGLANG_TRANSFER_BACKENDS = ("mooncake", "nixl")
PD_BACKENDS = ("vllm", "sglang")

# What the prefill request of vLLM's handshake carries (the fields its NIXL/Mooncake connectors read).
VLLM_PREFILL_TRANSFER = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class PDSpec:
    """Layout of one disaggregated replica."""

    prefill_tp: int = 1
    decode_tp: int = 1
    n_decode: int = 1
    n_prefill: int = 1
    dp: int = 1
    pp: int = 1
    nnodes: int = 1
    transfer_backend: str = "nixl"

    @classmethod
    def from_config(cls, pd: Any) -> PDSpec:
        """From `rollout.pd` (mrl/config/schema.py PDConfig)."""
        return cls(pd.prefill_tp, pd.decode_tp, pd.n_decode, transfer_backend=pd.transfer_backend)

    @property
    def devices(self) -> int:
        return self.prefill_tp * self.n_prefill + self.decode_tp * self.n_decode

    def member_slots(self) -> list[tuple[str, int, int]]:
        """(role, first slot, slot count) of each member, prefill first, relative to the replica's first slot."""
        slots = [("prefill", 0, self.prefill_tp)]
        for i in range(self.n_decode):
            slots.append((f"decode{i}", self.prefill_tp + i * self.decode_tp, self.decode_tp))
        return slots

    def check(self, backend: str) -> None:
        """Reject what no backend here supports, naming the setting and the rule."""
        for name, value in (("prefill_tp", self.prefill_tp), ("decode_tp", self.decode_tp),
                            ("n_decode", self.n_decode)):
            if value < 1:
                raise ValueError(f"rollout.pd.{name} must be >= 1, got {value}")
        if backend not in PD_BACKENDS:
            raise ValueError(f"rollout.name={backend!r} has no prefill/decode-disaggregated path; PD replicas run on "
                             f"{list(PD_BACKENDS)} (TensorRT-LLM's disaggregated serving is its own server)")
        rules = (
            ("n_prefill", self.n_prefill, "one prefill server per replica (scale with more replicas)"),
            ("dp", self.dp, "data parallel 1 inside a PD replica"),
            ("pp", self.pp, "pipeline parallel 1 inside a PD replica"),
            ("nnodes", self.nnodes, "a PD replica on one node"),
        )
        for name, value, rule in rules:
            if value != 1:
                raise ValueError(f"rollout.pd.{name}={value}: PD replicas support {rule}; set it to 1")
        allowed = tuple(VLLM_CONNECTORS) if backend == "vllm" else SGLANG_TRANSFER_BACKENDS
        if self.transfer_backend not in allowed:
            raise ValueError(f"rollout.pd.transfer_backend={self.transfer_backend!r}: the {backend} PD path accepts "
                             f"{list(allowed)}")


def vllm_kv_transfer_config(spec: PDSpec, role: str, kv_buffer_device: str) -> dict[str, Any]:
    """The `kv_transfer_config` engine argument (vllm.config.KVTransferConfig fields) of one member.

    NIXL members are `kv_both` (the decode side pulls, the prefill side serves); Mooncake has a producer and
    consumers. `kv_buffer_device` is "cuda" on GPU and "cpu" on vLLM-CPU (the only buffer NIXL supports there).
    """
    if spec.transfer_backend == "nixl":
        kv_role = "kv_both"
    else:
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return {
        "kv_connector": VLLM_CONNECTORS[spec.transfer_backend],
        "kv_role": kv_role,
        "kv_buffer_device": kv_buffer_device,
    }


def vllm_member_env(spec: PDSpec, member_index: int, base_port: int) -> dict[str, str]:
    """Per-member ports of the connector's side channel: members share one host, so each needs its own."""
    key = "VLLM_NIXL_SIDE_CHANNEL_PORT" if spec.transfer_backend == "nixl" else "VLLM_MOONCAKE_BOOTSTRAP_PORT"
    return {key: str(base_port + member_index)}


def sglang_member_args(spec: PDSpec, role: str, bootstrap_port: int) -> list[str]:
    """Launch arguments that put one SGLang server in its disaggregation mode (srt/server_args.py flags)."""
    mode = "prefill" if role == "prefill" else "decode"
    args = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", spec.transfer_backend]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return args


def sglang_bootstrap(host: str, port: int, room: int | None = None) -> dict[str, Any]:
    """The fields sglang-router adds to a request sent to both servers: where the prefill server's bootstrap
    listens and a random room id pairing the two halves (GenerateReqInput.bootstrap_*)."""
    return {"bootstrap_host": host, "bootstrap_port": int(port),
            "bootstrap_room": random.getrandbits(63) if room is None else int(room)}


# ---- request-scoped transfer parameters ---------------------------------------------------------------------
# The adapter protocol's `generate` takes the unified sampling dict only; the PD handshake rides beside it in a
# context variable (the adapter's `_generate` runs in the caller's task, so it sees the caller's value). The dict is
# mutable: a prefill member writes what its engine returned under "received".
TRANSFER: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("mrl_pd_transfer", default=None)


async def generate_with_transfer(
    adapter: Any, request_id: str, prompt_ids: list[int], sampling: dict[str, Any], send: dict[str, Any]
) -> tuple[TokenOutput, Any]:
    """Run `adapter.generate` with `send` as the request's transfer parameters; returns (output, what came back)."""
    transfer = {"send": send, "received": None}
    token = TRANSFER.set(transfer)
    try:
        out = await adapter.generate(request_id, prompt_ids, sampling)
    finally:
        TRANSFER.reset(token)
    return out, transfer["received"]


class PDRouter:
    """One disaggregated replica's front: PD routing for `generate`, fan-out for control.

    `prefill` and `decodes` are members exposing RolloutServer's async methods plus
    `generate_transfer(request_id, prompt_ids, sampling, send) -> (TokenOutput, received)` (see `LocalMember`,
    `ActorMember`). `bootstrap` is SGLang's (host, port) of the prefill server.
    """

    def __init__(self, backend: str, prefill: Any, decodes: list[Any], bootstrap: tuple[str, int] | None = None,
                 member_devices: list[int] | None = None):
        if backend not in PD_BACKENDS:
            raise ValueError(f"no PD routing for backend {backend!r}; known: {list(PD_BACKENDS)}")
        if not decodes:
            raise ValueError("a PD replica needs at least one decode server")
        if backend == "sglang" and bootstrap is None:
            raise ValueError("sglang PD routing needs the prefill server's bootstrap (host, port)")
        self.backend = backend
        self.prefill = prefill
        self.decodes = {f"decode{i}": member for i, member in enumerate(decodes)}
        self.bootstrap = bootstrap
        self.balancer = LoadBalancer(dict(self.decodes))
        self.routes: dict[str, int] = {name: 0 for name in self.decodes}  # requests served per decode member
        self.paused = False  # admission closed by the caller's abort_all until resume_generation
        # Engine workers per member (prefill first): how a weight-sync group's ranks divide among the members.
        self.member_devices = member_devices or [1] * (1 + len(decodes))

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        name, decode = self.balancer.acquire(request_id)
        try:
            if self.backend == "vllm":
                out = await self._generate_vllm(decode, request_id, prompt_ids, sampling_params)
            else:
                out = await self._generate_sglang(decode, request_id, prompt_ids, sampling_params)
        finally:
            self.balancer.release(name)
        self.routes[name] += 1
        out.extra["pd_decode"] = name
        return out

    async def generate_many(self, calls: list[tuple[str, list[int], dict[str, Any]]]) -> AsyncIterator[list]:
        """Many `generate` calls in one RPC, streamed back in groups (mrl/rollout/bursts.py): the rollout client
        sends a PD replica its bursts like any other server."""
        async for done in serve_many(self.generate, calls):
            yield done

    async def _generate_vllm(self, decode: Any, request_id: str, prompt_ids: list[int],
                             sampling: dict[str, Any]) -> TokenOutput:
        params = normalize_sampling(sampling)
        if params["max_tokens"] == 0:
            out, _ = await decode.generate_transfer(request_id, prompt_ids, params, None)
            return out
        first, received = await self.prefill.generate_transfer(
            request_id, prompt_ids, {**params, "max_tokens": 1}, dict(VLLM_PREFILL_TRANSFER))
        if not first.token_ids:  # aborted before its first token, or no room left in the context: nothing to decode
            return first
        if received is None:
            raise RuntimeError("the vLLM prefill server returned no kv_transfer_params: is its kv_transfer_config set?")
        out, _ = await decode.generate_transfer(request_id, prompt_ids, params, received)
        return out

    async def _generate_sglang(self, decode: Any, request_id: str, prompt_ids: list[int],
                               sampling: dict[str, Any]) -> TokenOutput:
        send = sglang_bootstrap(*self.bootstrap)
        _, (out, _) = await asyncio.gather(
            self.prefill.generate_transfer(request_id, prompt_ids, sampling, send),
            decode.generate_transfer(request_id, prompt_ids, sampling, send),
        )
        return out

    # ---- fan-out to every member ---------------------------------------------------------------------
    def members(self) -> dict[str, Any]:
        return {"prefill": self.prefill, **self.decodes}

    async def _all(self, method: str, *args: Any) -> dict[str, Any]:
        names = list(self.members())
        results = await asyncio.gather(*(getattr(m, method)(*args) for m in self.members().values()))
        return dict(zip(names, results))

    async def update_weights(self, buckets: Any, version: int) -> dict[str, int]:
        """Every member loads the same buckets (bytes, or Ray refs the member servers fetch) and takes `version`.

        Members update concurrently, so admission closes on all of them first and reopens only when all have
        loaded: otherwise a request could be prefilled by a member with the new weights and decoded by one still
        on the old (or the reverse), and its tokens would belong to no version. A pause the caller made with
        `abort_all` stays in place.
        """
        await self._all("abort_all")
        try:
            return await self._all("update_weights", buckets, version)
        finally:
            if not self.paused:
                await self._all("resume_generation")

    async def receive_weights(self, spec: dict[str, Any] | list, rank: int, version: int) -> dict[str, int]:
        """Every member joins a weight-sync transport (mrl/weight_sync) with its own workers: the group ranks
        `rank`… (or the per-device list of one (spec, rank) per worker) in member order, prefill first. Admission
        closes on all members until all have loaded, as in `update_weights`."""
        parts, start = [], 0
        for devices in self.member_devices:
            parts.append((spec[start:start + devices], 0) if isinstance(spec, list) else (spec, rank + start))
            start += devices
        await self._all("abort_all")
        try:
            names = list(self.members())
            loads = [m.receive_weights(s, r, version) for m, (s, r) in zip(self.members().values(), parts)]
            return dict(zip(names, await asyncio.gather(*loads)))
        finally:
            if not self.paused:
                await self._all("resume_generation")

    async def load_stats(self) -> list[dict[str, Any]]:
        """Each member's, prefill first."""
        return list((await self._all("load_stats")).values())

    async def abort_all(self) -> dict[str, int]:
        self.paused = True
        return await self._all("abort_all")

    async def resume_generation(self) -> None:
        self.paused = False
        await self._all("resume_generation")

    async def sleep(self, level: int = 2) -> None:
        await self._all("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._all("wake_up", tags)

    async def release_kv_cache(self) -> None:
        await self._all("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        await self._all("resume_kv_cache")

    async def clear_kv_cache(self) -> None:
        await self._all("clear_kv_cache")

    async def health(self) -> dict[str, Any]:
        members = await self._all("health")
        versions = {h["version"] for h in members.values()}
        return {"backend": self.backend, "pd": True, "version": min(versions), "versions_agree": len(versions) == 1,
                "routes": dict(self.routes), "members": members}


class LocalMember:
    """An in-process adapter (a PD member adapter from pd_members.py) behind RolloutServer's method names."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    async def generate_transfer(self, request_id: str, prompt_ids: list[int], sampling: dict[str, Any],
                                send: dict[str, Any] | None) -> tuple[TokenOutput, Any]:
        if send is None:
            return await self.adapter.generate(request_id, prompt_ids, sampling), None
        return await generate_with_transfer(self.adapter, request_id, prompt_ids, sampling, send)

    async def update_weights(self, buckets: list[bytes], version: int) -> int:
        return await self.adapter.update_weights_from_buckets(list(buckets), version)

    def __getattr__(self, name: str) -> Any:
        # abort_all, resume_generation, sleep, wake_up, *_kv_cache, health: the adapter's own coroutines.
        return getattr(self.adapter, name)


class ActorMember:
    """A member server actor (PDMemberServer) behind awaitable calls: `await member.x(...)` is `await
    actor.x.remote(...)`."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.handle, name)

        async def call(*args: Any) -> Any:
            return await method.remote(*args)

        return call
