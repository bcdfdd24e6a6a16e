"""The rollout adapter protocol every inference backend implements (DESIGN.md, "Rollout adapter").

An adapter owns one inference engine in one process and speaks token ids only:
`generate(request_id, prompt_ids, sampling_params) -> TokenOutput`. Everything above it (servers as Ray actors,
replicas, the load balancer, clients) is backend-agnostic and lives in `mrl/rollout/`.

Version contract: `update_weights(stream, version)` aborts whatever is running (those requests return with
stop_reason "aborted" and the tokens produced so far), loads the new weights, resets the prefix cache and
stores `version`; every TokenOutput carries the version of the weights that produced its tokens.
`load_lora_adapter(path, version)` is the same sequence for an adapter-only update: the engine keeps its base
weights, drops the previous adapter and loads the PEFT folder at `path`; from then on every generate call names
that adapter (`lora_name`) unless it names another one itself.

Pause contract: `abort_all()` aborts in-flight requests *and* closes admission; requests submitted afterwards
wait inside the adapter until `resume_generation()`. That is what lets a partial-rollout client retry at once
and have the retry run on the new weights (abort -> update -> resume).
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

StopReason = Literal["stop", "length", "aborted"]

# Unified sampling keys; backends translate them. `n` is deliberately absent: one request is one sample
# (RL trajectories are independent sessions); `LLMServerClient.generate_n` fans a prompt out to n requests.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,  # 0 means greedy
    "top_p": 1.0,
    "top_k": -1,  # -1 (or 0) disables top-k
    "max_tokens": 256,
    "logprobs": True,  # return each sampled token's log-prob under the distribution it was drawn from (tempered)
    "seed": None,
    "stop_token_ids": (),  # extra stop tokens; EOS stops too unless ignore_eos
    "ignore_eos": False,
    # Also return each prompt token's log-prob given the tokens before it, in TokenOutput.extra["prompt_log_probs"]
    # (one per prompt token, 0.0 for the first, which has none). Untempered: vLLM applies no sampling processor to
    # prompt tokens. A distillation teacher on replicas of its own scores the student's samples so.
    "prompt_logprobs": False,
}

# The tags of `wake_up`, in the order a hybrid replica must restore them: weights first (so they can be
# overwritten), then the update, then the KV cache (only needed once generation resumes).
WAKE_ORDER = ("weights", "kv_cache")


@dataclass
class TokenOutput:
    """One sample: generated ids, the log-prob of each (None when not requested), why it stopped, and the
    weight version that produced it. Stop tokens (EOS or stop_token_ids) are included in token_ids."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: StopReason
    version: int
    extra: dict[str, Any] = field(default_factory=dict)


def normalize_sampling(sampling_params: dict[str, Any] | None) -> dict[str, Any]:
    """Fill defaults and validate the unified sampling dict; unknown keys are an error, not silently ignored."""
    params = dict(SAMPLING_DEFAULTS)
    given = dict(sampling_params or {})
    if given.pop("n", 1) != 1:
        raise ValueError("sampling_params['n'] must be 1 at the adapter: use LLMServerClient.generate_n for n > 1")
    unknown = set(given) - set(SAMPLING_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown sampling keys {sorted(unknown)}; allowed: {sorted(SAMPLING_DEFAULTS)} and n")
    params.update(given)
    if params["temperature"] < 0:
        raise ValueError(f"sampling temperature must be >= 0 (0 = greedy), got {params['temperature']}")
    if not 0.0 < params["top_p"] <= 1.0:
        raise ValueError(f"sampling top_p must be in (0, 1], got {params['top_p']}")
    if params["top_k"] == 0:
        params["top_k"] = -1
    if params["max_tokens"] < 0:
        raise ValueError(f"sampling max_tokens must be >= 0, got {params['max_tokens']}")
    params["stop_token_ids"] = tuple(int(t) for t in params["stop_token_ids"])
    return params


def token_budget(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """Tokens a request may still generate: min(max_tokens, max_model_len - prompt_len), never negative."""
    return max(0, min(max_tokens, max_model_len - prompt_len))


class SleepState:
    """Which memory tags (weights, kv_cache) an adapter has released, and the wake-up order rule.

    `sleep(level)`: level 1 offloads weights (kept, e.g. LoRA base) and drops the KV cache; level 2 discards both
    (a full-weight update follows). Either way both tags are asleep until woken. Waking kv_cache while weights
    still sleep is refused, as is loading weights into released storage.
    """

    def __init__(self) -> None:
        self.asleep: set[str] = set()
        self.level = 0

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level}")
        self.asleep = set(WAKE_ORDER)
        self.level = level

    def wake_up(self, tags: Iterable[str] | None) -> list[str]:
        """Mark `tags` (all when None) awake; return them in WAKE_ORDER."""
        wanted = set(WAKE_ORDER if tags is None else tags)
        unknown = wanted - set(WAKE_ORDER)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; known: {list(WAKE_ORDER)}")
        if "kv_cache" in wanted and "weights" in self.asleep - wanted:
            raise RuntimeError("wake_up order is weights -> update_weights -> kv_cache: weights are still asleep")
        self.asleep -= wanted
        if not self.asleep:
            self.level = 0
        return [t for t in WAKE_ORDER if t in wanted]

    def require_awake(self, tag: str, action: str) -> None:
        if tag in self.asleep:
            raise RuntimeError(f"cannot {action}: '{tag}' is asleep (call wake_up(['{tag}']) first)")


class RolloutAdapter(ABC):
    """One inference engine behind the unified, token-in/token-out protocol (async: one event loop per server).

    Subclasses implement the engine-specific `_generate`, `_abort_running`, `_load_weights` and the memory hooks;
    admission gating, version stamping and the sleep state machine are shared here so both backends obey the
    same contract.
    """

    backend: str = ""
    supports_pipeline_parallel: bool = False
    # Whether `generate` returns prompt log-probs when the sampling dict asks (`prompt_logprobs`).
    serves_prompt_logprobs: bool = False
    supports_tensor_parallel: bool = False

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.version = 0
        self.sleep_state = SleepState()
        self._admit = asyncio.Event()
        self._admit.set()
        self._paused_by_abort = False
        self._running: dict[str, asyncio.Future] = {}
        self._waiting = 0  # requests parked while admission is closed
        self.events: collections.deque[str] = collections.deque(maxlen=1000)  # recent control calls, in order
        self.lora_name: str | None = None  # the loaded LoRA adapter generate calls name by default (None: base)

    # ---- generation -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       lora_name: str | None = None) -> TokenOutput:
        """`lora_name`: the loaded LoRA adapter to sample with (None: the current one, `self.lora_name`)."""
        params = normalize_sampling(sampling_params)
        if params["prompt_logprobs"] and not self.serves_prompt_logprobs:
            raise ValueError(f"sampling prompt_logprobs: the {self.backend or type(self).__name__} adapter does not "
                             "return prompt log-probs (vllm and hf do)")
        lora = lora_name or self.lora_name
        budget = token_budget(len(prompt_ids), params["max_tokens"], self.max_model_len)
        self._waiting += 1
        try:
            await self._admit.wait()
        finally:
            self._waiting -= 1
        if budget == 0:
            return TokenOutput([], [] if params["logprobs"] else None, "length", self.version)
        # The engine sees a fresh id per call: one high-level request_id spans many turns and retries.
        rid = f"{request_id}-{uuid.uuid4().hex[:12]}"
        started_version = self.version
        done = asyncio.get_running_loop().create_future()
        self._running[rid] = done
        try:
            # A backend may add a fourth item: what TokenOutput.extra carries (e.g. `routed_experts`).
            # Only an adapter-serving backend gets the keyword: the others keep their signature.
            lora_kw = {"lora_name": lora} if lora is not None else {}
            ids, lps, reason, *extra = await self._generate(rid, list(prompt_ids), params, budget, **lora_kw)
        finally:
            self._running.pop(rid, None)
            done.set_result(None)
        # Updates abort (and drain) running requests before loading, so an aborted request's tokens belong to the
        # version it started under, and one that finished ran entirely on the current weights.
        version = started_version if reason == "aborted" else self.version
        return TokenOutput(ids, lps if params["logprobs"] else None, reason, version, *extra)

    async def abort_all(self) -> int:
        """Abort in-flight requests and hold new ones until `resume_generation`; returns how many were running."""
        self.events.append("abort_all")
        self._paused_by_abort = True
        return await self._close_admission()

    async def resume_generation(self) -> None:
        self.events.append("resume_generation")
        self._paused_by_abort = False
        await self._maybe_reopen()

    async def _close_admission(self) -> int:
        """Stop admitting, abort what runs and wait until every aborted request has returned."""
        self._admit.clear()
        waiting = list(self._running.values())
        await self._abort_running()
        await asyncio.gather(*waiting)
        return len(waiting)

    async def _maybe_reopen(self) -> None:
        if not self._paused_by_abort and not self.sleep_state.asleep:
            self._admit.set()
            await self._reopen()

    # ---- weights ------------------------------------------------------------------------------------
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load HF-named tensors in place, reset the prefix cache, set `version`; returns tensors loaded."""
        from rollout_adapters.buckets import pack_buckets

        return await self.update_weights_from_buckets(pack_buckets(named_tensors), version)

    async def update_weights_from_buckets(self, buckets: Iterable[bytes] | AsyncIterator[bytes], version: int) -> int:
        """Same as update_weights, for a stream already packed into safetensors buckets (the wire format)."""
        return await self._update(lambda: self._load_weights(_aiter(buckets)), version)

    async def receive_weights(self, spec: dict[str, Any] | list, rank: int, version: int) -> int:
        """Same as update_weights, with the tensors arriving through a weight-sync transport (mrl/weight_sync):
        this engine's workers join the sender's group as ranks `rank`, `rank` + 1, …; or, given a list (a
        per-device sync, mrl/rollout/device_sync.py), worker i joins group `spec[i][0]` as rank `spec[i][1]`."""
        return await self._update(lambda: self._receive_weights(spec, rank), version)

    async def load_lora_adapter(self, path: str, version: int) -> int:
        """Serve the PEFT adapter folder at `path` on the base weights, stamped `version` (the previous adapter is
        dropped); returns the adapter's tensors. Named `v<version>`."""
        return await self._update(lambda: self._load_lora(path, f"v{int(version)}"), version)

    async def _update(self, load: Any, version: int) -> int:
        self.sleep_state.require_awake("weights", "update weights")
        self.events.append(f"update_weights:{version}")
        try:
            await self._close_admission()
            count = await load()
            await self.clear_kv_cache()
            self.version = int(version)
        finally:
            await self._maybe_reopen()
        return count

    # ---- memory -------------------------------------------------------------------------------------
    async def sleep(self, level: int = 2) -> None:
        """Abort what runs, then release memory (level 1: offload weights, level 2: discard them); new requests
        wait until every tag is awake again."""
        self.events.append(f"sleep:{level}")
        await self._close_admission()
        self.sleep_state.sleep(level)
        await self._sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> list[str]:
        woken = self.sleep_state.wake_up(tags)
        self.events.append("wake_up:" + ",".join(woken))
        await self._wake_up(woken)
        await self._maybe_reopen()
        return woken

    async def release_kv_cache(self) -> None:
        """Free the KV cache only (weight-sync critical section); aborts what runs first."""
        self.events.append("release_kv_cache")
        await self._close_admission()
        self.sleep_state.asleep.add("kv_cache")
        await self._release_kv_cache()

    async def resume_kv_cache(self) -> None:
        await self.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        """Invalidate the prefix cache (after every weight update: cached KV was computed by old weights)."""
        self.events.append("clear_kv_cache")
        await self._clear_prefix_cache()

    async def health(self) -> dict[str, Any]:
        await self._check_health()
        return {
            "backend": self.backend,
            "version": self.version,
            "in_flight": len(self._running),
            "waiting": self._waiting,
            "paused": not self._admit.is_set(),
            "asleep": sorted(self.sleep_state.asleep),
        }

    async def start(self) -> None:
        """Create the engine (inside the server's event loop: async engines need one)."""
        return None

    async def read_weights(self) -> dict[str, torch.Tensor]:
        """The engine's parameters as host tensors in the engine's own names (TP rank 0's shard), for checks that
        a sync delivered exactly the export; backends without a way to read them raise."""
        raise NotImplementedError(f"the {self.backend!r} backend cannot read its weights back")

    async def load_stats(self) -> dict[str, Any]:
        """How the last transport sync loaded, as far as the backend says (vLLM: straight into the parameters or
        layer by layer, and why); empty where it does not."""
        return {}

    async def shutdown(self) -> None:
        return None

    # ---- backend hooks (the optional ones do nothing by default, e.g. memory hooks where sleep is a no-op) ----
    @abstractmethod
    async def _generate(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], budget: int
    ) -> tuple[list[int], list[float], StopReason]: ...

    @abstractmethod
    async def _abort_running(self) -> None:
        """Abort every request in the engine; admission is already closed, and nothing may run until _reopen."""

    @abstractmethod
    async def _load_weights(self, buckets: AsyncIterator[bytes]) -> int:
        """Load safetensors buckets of HF-named tensors in place; return the number of tensors loaded."""

    async def _receive_weights(self, spec: dict[str, Any], rank: int) -> int:
        """Join a weight-sync transport's group as `rank` (+ worker index) and load what arrives in place."""
        raise NotImplementedError(
            f"weight_sync.transport={spec['transport']}: the {self.backend!r} rollout backend has no weight-sync "
            "receiver yet (vllm, hf, sglang and trtllm have one)"
        )

    async def _load_lora(self, path: str, name: str) -> int:
        """Replace the engine's LoRA adapter by the PEFT folder `path` named `name`; set `self.lora_name`."""
        raise NotImplementedError(f"actor.lora.sync=adapter: the {self.backend!r} rollout backend cannot load "
                                  "LoRA adapters (vllm can); use actor.lora.sync=merged")

    async def _reopen(self) -> None:
        return None

    async def _sleep(self, level: int) -> None:
        return None

    async def _wake_up(self, tags: list[str]) -> None:
        return None

    async def _release_kv_cache(self) -> None:
        return None

    async def _clear_prefix_cache(self) -> None:
        return None

    async def _check_health(self) -> None:
        return None


async def _aiter(items: Iterable[bytes] | AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if hasattr(items, "__aiter__"):
        async for item in items:  # type: ignore[union-attr]
            yield item
    else:
        for item in items:  # type: ignore[union-attr]
            yield item


# Backends by name, imported lazily: vLLM's import alone costs seconds and is absent on some machines.
ADAPTERS = {
    "vllm": "rollout_adapters.vllm.adapter:VLLMAdapter",
    "hf": "rollout_adapters.hf.adapter:HFAdapter",
    "sglang": "rollout_adapters.sglang.adapter:SGLangAdapter",
    "trtllm": "rollout_adapters.trtllm.adapter:TRTLLMAdapter",
}


def adapter_class(name: str) -> type[RolloutAdapter]:
    if name not in ADAPTERS:
        raise ValueError(f"rollout.name={name!r} is not a known backend; known: {sorted(ADAPTERS)}")
    module, _, cls = ADAPTERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
