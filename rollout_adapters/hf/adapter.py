"""The `hf` backend: the adapter protocol on a plain transformers model, dependency-light (laptops, quick tests).

Each request runs its own decode loop with a KV cache; all model work (forwards and weight loads) goes through
one worker thread, so a weight load can never interleave with a forward and requests interleave token by token.
transformers' continuous batching (`generate_batch`) was measured to return per-token log-probs too, but it is a
batch call: it cannot abort one request mid-way, take a weight update between tokens or seed each request, which
the protocol needs. Sleep levels are tracked (and the wake-up order enforced) but free no memory here.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rollout_adapters.base import RolloutAdapter, StopReason
from rollout_adapters.buckets import unpack_bucket


def sample_token(logits: torch.Tensor, params: dict[str, Any], generator: torch.Generator) -> tuple[int, float]:
    """Pick the next token from fp32 `logits` [V]; return it with its log-prob log_softmax(logits / T)[token].

    Temperature 0 is greedy. Otherwise logits / T, keep the top_k largest (top_k > 0), keep the smallest set whose
    probability mass reaches top_p (the most likely token always stays), sample. The returned log-prob is of the
    distribution the token was drawn from (tempered, then renormalised over what top-k / top-p keep; greedy: T = 1),
    as vLLM reports it in processed_logprobs mode: without top-k / top-p, what the trainer's forward pass scores.
    """
    if params["temperature"] == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    scaled = logits / params["temperature"]
    if params["top_k"] > 0 and params["top_k"] < scaled.numel():
        kth = torch.topk(scaled, params["top_k"]).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params["top_p"] < 1.0:
        probs_sorted, order = torch.sort(torch.softmax(scaled, dim=-1), descending=True)
        mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        drop = order[mass_before >= params["top_p"]]
        scaled[drop] = float("-inf")
    logp = torch.log_softmax(scaled, dim=-1)
    token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return token, float(logp[token])


# Replica-spec settings a one-request-at-a-time transformers loop has no counterpart for: no memory pool, prefix
# cache, batching, graphs or listening address; sampling seeds come per request.
NOT_APPLICABLE = frozenset({
    "seed", "pipeline_parallel_size", "data_parallel_size", "gpu_memory_utilization", "enable_prefix_caching",
    "enable_sleep_mode", "max_num_seqs", "max_num_batched_tokens", "enforce_eager", "host", "allow_remote_access",
})


class HFAdapter(RolloutAdapter):
    backend = "hf"
    serves_prompt_logprobs = True

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int = 2048,
        dtype: str = "float32",
        num_threads: int | None = 1,
        tensor_parallel_size: int = 1,
        engine_kwargs: dict[str, Any] | None = None,
        return_routed_experts: bool = False,
        **engine_settings: Any,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if tensor_parallel_size != 1:
            raise ValueError(f"rollout.tensor_model_parallel_size={tensor_parallel_size}: the hf backend runs TP=1")
        unknown = set(engine_settings) - NOT_APPLICABLE
        if unknown:
            raise TypeError(f"HFAdapter got unexpected settings {sorted(unknown)}")
        if engine_kwargs:
            raise ValueError(f"rollout.engine_kwargs={dict(engine_kwargs)}: the hf backend has no engine arguments")
        super().__init__(max_model_len)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-rollout")
        self._abort_epoch = 0
        self._routers = _routers(self.model) if return_routed_experts else []
        self._routed: list[torch.Tensor] = []  # the running forward's top-k per MoE layer (one model thread)
        for router in self._routers:
            router.register_forward_hook(self._record_routing)

    def _record_routing(self, module, args, output) -> None:
        # The router's own top-k indices (its last output): exactly what the experts were given.
        if not isinstance(output, tuple) or output[-1].is_floating_point():
            raise TypeError(f"return_routed_experts: {type(module).__name__} does not return top-k indices")
        self._routed.append(output[-1].detach().to(torch.int16))

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @torch.no_grad()
    def _forward(self, new_ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fed tokens' logits [len(new_ids), V] (fp32) and, with routed experts on, their routing
        [len(new_ids), L, K]."""
        self._routed = []
        out = self.model(input_ids=torch.tensor([new_ids]), past_key_values=cache, use_cache=True)
        routing = torch.stack(self._routed, dim=1) if self._routers else None
        return out.logits[0].float(), routing

    async def _generate(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], budget: int
    ) -> tuple[list[int], list[float], StopReason, dict[str, Any]]:
        from transformers import DynamicCache

        epoch = self._abort_epoch
        generator = torch.Generator()
        generator.manual_seed(params["seed"] if params["seed"] is not None else int(torch.randint(2**62, ())))
        stops = set(params["stop_token_ids"]) | (set() if params["ignore_eos"] else self.eos_ids)
        cache = DynamicCache(config=self.model.config)
        ids: list[int] = []
        lps: list[float] = []
        routed: list[torch.Tensor] = []
        extra: dict[str, Any] = {}
        feed = prompt_ids
        reason: StopReason = "length"
        while len(ids) < budget:
            if self._abort_epoch != epoch:
                reason = "aborted"
                break
            logits, routing = await self._run(self._forward, feed, cache)
            if feed is prompt_ids and params["prompt_logprobs"]:  # untempered, as vLLM gives them
                scores = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(prompt_ids[1:]).unsqueeze(-1))
                extra["prompt_log_probs"] = [0.0, *scores.squeeze(-1).tolist()]
            logits = logits[-1]
            if routing is not None:
                routed.append(routing)
            if self._abort_epoch != epoch:
                reason = "aborted"
                break
            token, logp = sample_token(logits, params, generator)
            ids.append(token)
            lps.append(logp)
            if token in stops:
                reason = "stop"
                break
            feed = [token]
        # Routing of every token fed: the prompt and all sampled tokens but the last (vLLM's layout too).
        if routed:
            extra["routed_experts"] = torch.cat(routed)
        return ids, lps, reason, extra

    async def _abort_running(self) -> None:
        self._abort_epoch += 1

    async def _load_weights(self, buckets: AsyncIterator[bytes]) -> int:
        count = 0
        async for blob in buckets:
            count += await self._run(self._load_bucket, blob)
        return count

    async def _receive_weights(self, spec: dict[str, Any] | list, rank: int) -> int:
        from mrl.weight_sync import receive_into

        if isinstance(spec, list):  # per-device sync: this one worker's own group
            ((spec, rank),) = spec

        # On the model thread: loads never interleave with a forward (and the transport's waits block no loop).
        return await self._run(receive_into, spec, rank, self._load_named)

    def _load_bucket(self, blob: bytes) -> int:
        return self._load_named(unpack_bucket(blob))

    @torch.no_grad()
    def _load_named(self, named: list[tuple[str, torch.Tensor]]) -> int:
        rest = [(n, t) for n, t in named if not _load_expert(self.model, n, t)]
        result = self.model.load_state_dict(dict(rest), strict=False, assign=False)
        if result.unexpected_keys:
            raise KeyError(f"weights not in the model: {sorted(result.unexpected_keys)[:8]}")
        return len(named)

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


_EXPERT = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight")


def _load_expert(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Copy one per-expert tensor (the safetensors/export name) into transformers 5's fused in-memory experts
    (`gate_up_proj` [E, 2I, H] = gate rows then up rows, `down_proj` [E, H, I]); False if `name` is no such tensor
    or the model keeps that expert unfused."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return False
    experts, e, proj = match["experts"], int(match["e"]), match["proj"]
    try:
        fused = model.get_parameter(f"{experts}.{'down_proj' if proj == 'down' else 'gate_up_proj'}")
    except AttributeError:
        return False
    rows = tensor.shape[0]
    target = fused[e] if proj == "down" else fused[e, :rows] if proj == "gate" else fused[e, rows:]
    target.copy_(tensor)
    return True


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of a transformers model (`mlp.gate` modules whose output ends with the top-k indices), in
    layer order; a model without them cannot return routed experts."""
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]
    if not routers:
        raise ValueError(f"return_routed_experts: {type(model).__name__} has no MoE router (mlp.gate with a top_k) "
                         "whose top-k the hf backend can read; router replay needs an MoE model")
    return routers
