"""actor.lora.sync=adapter: the start-up rules name what vLLM's LoRA path cannot serve; the PEFT folder a sync
writes has vLLM's names (fused QKV / gate-up split per projection) and the trainer's scaling; the folders keep
only the newest version."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from mrl.config import ConfigError
from mrl.config.schema import LoRAConfig
from mrl.config.startup.loader import load_config
from mrl.engine.megatron import lora_peft
from rollout_adapters.vllm.adapter import engine_lora_rank

ADAPTER = ["model.path=unused", "actor.lora.enable=true", "actor.lora.sync=adapter", "rollout.sleep_level=1"]


@pytest.mark.parametrize(
    ("overrides", "setting", "words"),
    [
        (["actor.lora.sync=peft"], "actor.lora.sync", "merged, adapter"),
        (["rollout.name=sglang"], "actor.lora.sync", "rollout.name=vllm"),
        (["actor.lora.rank=1024"], "actor.lora.rank", "up to 512"),
        (["rollout.data_parallel_size=2"], "actor.lora.sync", "rollout.data_parallel_size=1"),
        (["rollout.sleep_level=2"], "rollout.sleep_level", "level 1"),
        (["resources.nnodes=2"], "actor.lora.sync", "one node"),
    ],
)
def test_adapter_sync_refuses_what_vllm_lora_cannot_serve(overrides, setting, words):
    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo", ADAPTER + overrides, check_paths=False)
    lines = [v for v in err.value.violations if v.setting == setting]
    assert lines and words in lines[0].rule, err.value


def test_merged_is_the_default_and_adapter_mode_loads():
    assert load_config("tiny/grpo", ["model.path=unused"], check_paths=False).actor.lora.sync == "merged"
    assert load_config("tiny/grpo", ADAPTER, check_paths=False).actor.lora.sync == "adapter"


def test_engine_rank_is_the_smallest_vllm_accepts():
    assert [engine_lora_rank(r) for r in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


def test_peft_names_and_config_match_what_vllm_reads(tmp_path):
    assert lora_peft.peft_name("model.layers.3.self_attn.q_proj.weight", "A") == \
        "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    tensors = {lora_peft.peft_name(f"model.layers.0.{m}.weight", f): torch.randn(4, 8)
               for m in ("self_attn.q_proj", "mlp.down_proj") for f in "AB"}
    settings = LoRAConfig(enable=True, rank=4, alpha=12.0, sync="adapter")
    nbytes = lora_peft.write_folder(str(tmp_path / "v1"), tensors, settings, "/models/base")
    assert nbytes == 4 * 4 * 8 * 4
    config = json.loads((tmp_path / "v1" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 12.0, False)  # vLLM: alpha / r
    assert config["target_modules"] == ["down_proj", "q_proj"] and config["peft_type"] == "LORA"
    loaded = load_file(tmp_path / "v1" / "adapter_model.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_folders_keep_only_the_newest_version(tmp_path):
    folders = lora_peft.AdapterFolders(str(tmp_path))
    for version in (1, 2, 3):
        path = folders.path(version)
        os.makedirs(path)
        folders.replace(path)
    assert sorted(os.listdir(tmp_path)) == ["v3"]
    assert lora_peft.AdapterFolders("rel").path(4) == os.path.join(os.getcwd(), "rel", "v4")
    default = lora_peft.AdapterFolders().root
    os.rmdir(default)
    assert default.startswith("/dev/shm/mrl-lora-")  # tmpfs: a sync writes no disk


def test_convert_peft_needs_a_lora_checkpoint(tmp_path):
    from mrl.tools.convert import ToHF, check_steps

    with pytest.raises(ConfigError) as err:
        check_steps([ToHF(str(tmp_path), str(tmp_path / "out"), peft=str(tmp_path / "peft"))])
    assert any(v.setting == "--peft" and "lora.json" in v.rule for v in err.value.violations), err.value
