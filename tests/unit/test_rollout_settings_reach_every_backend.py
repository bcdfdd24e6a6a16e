"""Every rollout setting reaches the engine argument it names, on every backend that has one (built from a config,
no live engine); vLLM's arguments are also parsed by the installed vLLM's own `AsyncEngineArgs`, so a renamed
argument fails here. `engine_kwargs` keys that a setting fills are refused, at start-up and by the adapter."""

import dataclasses
import os

import pytest
import torch
from safetensors import safe_open

from mrl.config import ConfigError
from mrl.config.engine_fields import SETTING_OF
from mrl.config.startup import load_config
from mrl.trainer.build import rollout_spec
from rollout_adapters.sglang import protocol
from rollout_adapters.sglang.adapter import SGLangAdapter
from rollout_adapters.trtllm.adapter import TRTLLMAdapter
from rollout_adapters.vllm.adapter import VLLMAdapter

SETTINGS = [
    "model.path=/models/m", "data.max_prompt_length=100", "data.max_response_length=28", "trainer.seed=7",
    "rollout.dtype=float16", "rollout.gpu_memory_utilization=0.37", "rollout.enable_prefix_caching=false",
    "rollout.enable_sleep_mode=true", "rollout.max_num_seqs=48", "rollout.max_num_batched_tokens=3000",
    "rollout.enforce_eager=true", "rollout.tensor_model_parallel_size=2", "resources.n_gpus_per_node=12",
]


def adapter_kwargs(backend: str, *extra: str, check: bool = True) -> tuple[str, dict]:
    cfg = load_config("tiny/grpo", [*SETTINGS, f"rollout.name={backend}", *extra], check_paths=False, check=check)
    spec = rollout_spec(cfg)
    return spec.model_path, spec.adapter_kwargs()


def test_vllm_engine_args_carry_every_setting(tmp_path):
    from mrl.models.tiny import make_tiny_hf_model

    model = str(make_tiny_hf_model("qwen2", tmp_path / "m", tokenizer=False))  # vLLM's arguments read its config
    path, kwargs = adapter_kwargs("vllm", "rollout.pipeline_model_parallel_size=3", f"model.path={model}")
    args = VLLMAdapter(path, **kwargs).engine_args
    expected = {
        "model": model, "dtype": "float16", "max_model_len": 128, "tensor_parallel_size": 2,
        "pipeline_parallel_size": 3, "data_parallel_size": 1, "seed": 7, "gpu_memory_utilization": 0.37,
        "enforce_eager": True, "enable_prefix_caching": False, "enable_sleep_mode": True, "max_num_seqs": 48,
        "max_num_batched_tokens": 3000,
    }
    assert {k: args[k] for k in expected} == expected
    assert set(SETTING_OF["vllm"]) <= set(args)  # every argument the table names is one the adapter sets
    from vllm.engine.arg_utils import AsyncEngineArgs

    parsed = AsyncEngineArgs(**args)  # raises on a name this vLLM does not know
    assert {k: getattr(parsed, k) for k in expected} == expected


def test_sglang_server_flags_carry_every_setting():
    # Engine DP is refused at start-up (weight syncs reach one engine's TP×PP workers); its flag still translates.
    path, kwargs = adapter_kwargs("sglang", "rollout.data_parallel_size=2", check=False)
    argv = protocol.server_command(path, port=30000, **SGLangAdapter(path, **kwargs).launch)

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert argv[argv.index("--model-path") + 1] == "/models/m"
    assert (flag("--dtype"), flag("--context-length"), flag("--tp-size"), flag("--dp-size")) == ("float16", "128", "2",
                                                                                                  "2")
    assert (flag("--random-seed"), flag("--mem-fraction-static")) == ("7", "0.37")
    assert (flag("--max-running-requests"), flag("--chunked-prefill-size")) == ("48", "3000")
    assert {"--disable-cuda-graph", "--disable-radix-cache", "--enable-memory-saver"} <= set(argv)
    defaults = protocol.server_command(path, port=30000, **SGLangAdapter(path).launch)
    assert not {"--disable-cuda-graph", "--disable-radix-cache", "--mem-fraction-static"} & set(defaults)
    assert "--enable-memory-saver" in defaults  # sleep needs it; off only when enable_sleep_mode=false


def test_trtllm_llm_args_carry_every_setting():
    # TP/PP > 1 are refused at start-up (a replica's server holds one device slot); their arguments still translate.
    path, kwargs = adapter_kwargs("trtllm", "rollout.pipeline_model_parallel_size=2", check=False)
    args = TRTLLMAdapter(path, **kwargs).llm_kwargs
    assert {k: args[k] for k in ("model", "dtype", "max_seq_len", "tensor_parallel_size", "pipeline_parallel_size",
                                 "enable_sleep", "max_batch_size", "max_num_tokens")} == {
        "model": "/models/m", "dtype": "float16", "max_seq_len": 128, "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2, "enable_sleep": True, "max_batch_size": 48, "max_num_tokens": 3000}
    assert args["kv_cache_config"] == {"free_gpu_memory_fraction": 0.37, "enable_block_reuse": False}
    assert args["cuda_graph_config"] is None  # enforce_eager
    assert "cuda_graph_config" not in TRTLLMAdapter(path).llm_kwargs


def test_rollout_dtype_defaults_to_the_trainers_parameter_dtype():
    cfg = load_config("tiny/grpo", ["model.path=/m", "actor.megatron.params_dtype=bfloat16"], check_paths=False)
    assert rollout_spec(cfg).dtype == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the defaults checked here are the CPU ones")
def test_vllm_cpu_defaults_eager_and_an_unchunked_prefill_budget():
    args = VLLMAdapter("/m", max_model_len=100).engine_args
    assert args["enforce_eager"] is True and args["enable_sleep_mode"] is False
    assert (args["max_num_seqs"], args["max_num_batched_tokens"]) == (256, 25600)
    assert "gpu_memory_utilization" not in args  # None leaves vLLM's default
    assert VLLMAdapter("/m", enforce_eager=False).engine_args["enforce_eager"] is False


@pytest.mark.parametrize("backend,key,setting", [
    ("vllm", "gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    ("vllm", "enforce_eager", "rollout.enforce_eager"),
    ("sglang", "mem_fraction_static", "rollout.gpu_memory_utilization"),
    ("trtllm", "kv_cache_config", "rollout.gpu_memory_utilization"),
])
def test_engine_kwargs_that_shadow_a_setting_are_refused_naming_it(backend, key, setting):
    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo", ["model.path=/m", f"rollout.name={backend}", f"+rollout.engine_kwargs.{key}=1"],
                    check_paths=False)
    named = [v for v in err.value.violations if v.setting == f"rollout.engine_kwargs.{key}"]
    assert any(setting in v.rule and "fills this engine argument" in v.rule for v in named), named
    adapter = {"vllm": VLLMAdapter, "sglang": SGLangAdapter, "trtllm": TRTLLMAdapter}[backend]
    with pytest.raises(ValueError, match=setting.replace(".", r"\.")):
        adapter("/m", engine_kwargs={key: 1})


def test_sglang_extra_args_flags_count_as_keys():
    with pytest.raises(ConfigError, match=r"rollout\.server_host"):
        load_config("tiny/grpo", ["model.path=/m", "rollout.name=sglang",
                                  "+rollout.engine_kwargs.extra_args=['--host=0.0.0.0']"], check_paths=False)


def test_every_engine_setting_of_the_replica_spec_is_a_rollout_field():
    from mrl.config.schema import RolloutConfig
    from mrl.rollout.replica import ReplicaSpec

    fields = {f.name for f in dataclasses.fields(RolloutConfig)}
    engine_settings = {"gpu_memory_utilization", "enable_prefix_caching", "enable_sleep_mode", "max_num_seqs",
                       "max_num_batched_tokens", "enforce_eager"}
    assert engine_settings <= fields & {f.name for f in dataclasses.fields(ReplicaSpec)}


def test_vllm_fp8_starts_from_a_block_fp8_copy_of_the_model(tmp_path, monkeypatch):
    import tempfile

    from mrl.models.tiny import make_tiny_hf_model
    from rollout_adapters.vllm.adapter import fp8_copy_path

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    model = str(make_tiny_hf_model("qwen2", tmp_path / "m", tokenizer=False, dtype=torch.bfloat16))
    fp8 = [f"model.path={model}", "rollout.quantization=fp8", "rollout.dtype=bfloat16"]
    path, kwargs = adapter_kwargs("vllm", *fp8, check=False)  # this CPU has no block-FP8 kernel: refused here
    adapter = VLLMAdapter(path, **kwargs)
    args = adapter.engine_args
    assert args["quantization"] == "fp8" and adapter.source_model == model
    assert args["model"] == fp8_copy_path(model) and args["model"].startswith(str(tmp_path / "tmp" / "mrl-fp8"))
    plain_path, plain = adapter_kwargs("vllm", f"model.path={model}")
    assert VLLMAdapter(plain_path, **plain).engine_args["quantization"] is None
    from vllm.engine.arg_utils import AsyncEngineArgs

    from mrl.weight_sync.fp8 import write_quantized_copy

    write_quantized_copy(model, args["model"])  # what `start` does before the engine reads the folder
    assert AsyncEngineArgs(**args).quantization == "fp8"
    # The scale format: its own copy (power-of-two scales) and DeepGEMM's E8M0 on for it, off for fp32 scales.
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "")  # restored after the test
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "")
    path, kwargs = adapter_kwargs("vllm", *fp8, "rollout.fp8_scale_format=ue8m0", check=False)
    ue8m0 = VLLMAdapter(path, **kwargs)
    assert ue8m0.engine_args["model"] == fp8_copy_path(model, "ue8m0") != args["model"]
    ue8m0.prepare_quantized_model()
    assert os.environ["VLLM_USE_DEEP_GEMM_E8M0"] == "1"
    with safe_open(f"{ue8m0.engine_args['model']}/model.safetensors", "pt") as f:
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
    assert torch.equal(scale, torch.pow(2.0, torch.log2(scale).round()))
    assert os.environ["VLLM_USE_DEEP_GEMM"] == "1"  # vLLM's default GEMM unless rollout.fp8_gemm says cutlass
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "")
    path, kwargs = adapter_kwargs("vllm", *fp8, "rollout.fp8_gemm=cutlass", check=False)
    VLLMAdapter(path, **kwargs).prepare_quantized_model()  # the copy exists: only the environment is set
    assert os.environ["VLLM_USE_DEEP_GEMM"] == "0" and os.environ["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    (tmp_path / "m" / "model.safetensors").write_bytes((tmp_path / "m" / "model.safetensors").read_bytes())
    assert fp8_copy_path(model) != args["model"]  # a rewritten model gets a new copy
    for backend in ("sglang", "trtllm"):
        path, kwargs = adapter_kwargs(backend, *fp8, check=False)
        adapter_cls = SGLangAdapter if backend == "sglang" else TRTLLMAdapter
        with pytest.raises(TypeError, match="quantization"):  # start-up refuses it first, naming the backend
            adapter_cls(path, **kwargs)
