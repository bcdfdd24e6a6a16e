"""Which engine argument of each backend a named rollout setting fills.

DESIGN.md: every configuration field reaches the component it names. The adapters build their engine arguments
from the replica spec (mrl/rollout/replica.py), and `rollout.engine_kwargs` passes the rest through verbatim; a
pass-through key that one of the settings below already fills is refused at start-up, naming the setting, so a
value can never be set twice and silently lose (the first GPU run's OOM: the memory fraction never reached vLLM).
Kept free of engine imports: start-up validation reads it on machines without the backend.
"""

from __future__ import annotations

CONTEXT = "data.max_prompt_length + data.max_response_length"

# backend -> {engine argument: the setting that fills it}
SETTING_OF: dict[str, dict[str, str]] = {
    "vllm": {
        "model": "model.path",
        "dtype": "rollout.dtype",
        "quantization": "rollout.quantization",
        "max_model_len": CONTEXT,
        "tensor_parallel_size": "rollout.tensor_model_parallel_size",
        "pipeline_parallel_size": "rollout.pipeline_model_parallel_size",
        "data_parallel_size": "rollout.data_parallel_size",
        "seed": "trainer.seed",
        "gpu_memory_utilization": "rollout.gpu_memory_utilization",
        "enforce_eager": "rollout.enforce_eager",
        "enable_prefix_caching": "rollout.enable_prefix_caching",
        "enable_sleep_mode": "rollout.enable_sleep_mode",
        "max_num_seqs": "rollout.max_num_seqs",
        "max_num_batched_tokens": "rollout.max_num_batched_tokens",
        "worker_extension_cls": "mrl's weight receiver (rollout_adapters/vllm/worker_extension.py)",
    },
    # SGLang server flags, as `--flag-name` in engine_kwargs.extra_args or as flag_name keys.
    "sglang": {
        "model_path": "model.path",
        "dtype": "rollout.dtype",
        "context_length": CONTEXT,
        "tp_size": "rollout.tensor_model_parallel_size",
        "dp_size": "rollout.data_parallel_size",
        "random_seed": "trainer.seed",
        "mem_fraction_static": "rollout.gpu_memory_utilization",
        "disable_cuda_graph": "rollout.enforce_eager",
        "disable_radix_cache": "rollout.enable_prefix_caching",
        "enable_memory_saver": "rollout.enable_sleep_mode",
        "max_running_requests": "rollout.max_num_seqs",
        "chunked_prefill_size": "rollout.max_num_batched_tokens",
        "host": "rollout.server_host",
        "port": "the replica (a free loopback port)",
    },
    "trtllm": {
        "model": "model.path",
        "dtype": "rollout.dtype",
        "max_seq_len": CONTEXT,
        "tensor_parallel_size": "rollout.tensor_model_parallel_size",
        "pipeline_parallel_size": "rollout.pipeline_model_parallel_size",
        "kv_cache_config": "rollout.gpu_memory_utilization and rollout.enable_prefix_caching",
        "enable_sleep": "rollout.enable_sleep_mode",
        "max_batch_size": "rollout.max_num_seqs",
        "max_num_tokens": "rollout.max_num_batched_tokens",
        "cuda_graph_config": "rollout.enforce_eager",
    },
    "hf": {},
}


# Backends whose adapter, not an engine-argument class, takes engine_kwargs: SGLang's server flags travel as
# `extra_args` (a command line), and the hf backend has no engine arguments.
ADAPTER_ENGINE_KWARGS: dict[str, tuple[str, ...]] = {"sglang": ("extra_args",), "hf": ()}


def shadowed_settings(backend: str, engine_kwargs: dict) -> list[tuple[str, str]]:
    """(engine_kwargs key, the setting to use instead) for every pass-through key a named setting fills; SGLang's
    `extra_args` flags count as keys."""
    table = SETTING_OF.get(backend, {})
    keys = [str(k) for k in engine_kwargs if k != "extra_args"]
    if backend == "sglang":
        for arg in engine_kwargs.get("extra_args", ()):
            if str(arg).startswith("--"):
                keys.append(str(arg)[2:].split("=", 1)[0].replace("-", "_"))
    return [(key, table[key]) for key in keys if key in table]


def refuse_shadowing(backend: str, engine_kwargs: dict) -> None:
    """The adapters' own guard (start-up validation reports the same as one line per key)."""
    clashes = shadowed_settings(backend, engine_kwargs)
    if clashes:
        raise ValueError("; ".join(f"rollout.engine_kwargs.{key}: set {setting} instead (it fills that argument)"
                                   for key, setting in clashes))
