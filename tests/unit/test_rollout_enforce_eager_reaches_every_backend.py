"""`rollout.enforce_eager` reaches the engine: vLLM's enforce_eager (default: eager on CPU, graphs on GPU), SGLang's
--disable-cuda-graph, TensorRT-LLM's cuda_graph_config=None; a verbatim engine kwarg still wins."""

import pytest
import torch

from mrl.config import load_config
from mrl.trainer.build import rollout_spec
from rollout_adapters.sglang import protocol
from rollout_adapters.sglang.adapter import SGLangAdapter
from rollout_adapters.trtllm.adapter import TRTLLMAdapter
from rollout_adapters.vllm.adapter import VLLMAdapter


def spec_kwargs(*overrides: str) -> dict:
    cfg = load_config("tiny/grpo", ["model.path=unused", *overrides], check_paths=False)
    return rollout_spec(cfg).adapter_kwargs()


def test_the_setting_travels_from_config_to_adapter_kwargs():
    assert spec_kwargs()["enforce_eager"] is None
    assert spec_kwargs("rollout.enforce_eager=false")["enforce_eager"] is False
    assert spec_kwargs("rollout.enforce_eager=true")["enforce_eager"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default checked here is the CPU one")
def test_vllm_defaults_to_eager_on_cpu_and_follows_the_setting():
    assert VLLMAdapter("/m").engine_args["enforce_eager"] is True
    assert VLLMAdapter("/m", enforce_eager=False).engine_args["enforce_eager"] is False
    verbatim = VLLMAdapter("/m", enforce_eager=False, engine_kwargs={"enforce_eager": True})
    assert verbatim.engine_args["enforce_eager"] is True


def test_sglang_and_trtllm_turn_their_graphs_off_only_when_asked():
    def argv(adapter: SGLangAdapter) -> list[str]:
        return protocol.server_command("/m", port=30000, **adapter.launch)

    assert "--disable-cuda-graph" in argv(SGLangAdapter("/m", enforce_eager=True))
    assert "--disable-cuda-graph" not in argv(SGLangAdapter("/m")) + argv(SGLangAdapter("/m", enforce_eager=False))
    assert TRTLLMAdapter("/m", enforce_eager=True).llm_kwargs["cuda_graph_config"] is None
    assert "cuda_graph_config" not in TRTLLMAdapter("/m").llm_kwargs
    assert "cuda_graph_config" not in TRTLLMAdapter("/m", enforce_eager=False).llm_kwargs
