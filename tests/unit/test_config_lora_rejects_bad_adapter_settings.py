"""actor.lora: each bad adapter setting fails at load time, naming the setting and the rule."""

import pytest

from mrl.config import ConfigError
from mrl.config.startup.loader import load_config

VALID = ["model.path=unused", "actor.lora.enable=true"]


@pytest.mark.parametrize(
    ("overrides", "setting", "words"),
    [
        (["actor.lora.rank=0"], "actor.lora.rank", "> 0"),
        (["actor.lora.alpha=0"], "actor.lora.alpha", "> 0"),
        (["actor.lora.dropout=1.0"], "actor.lora.dropout", "[0, 1)"),
        (["actor.lora.dropout=-0.1"], "actor.lora.dropout", "[0, 1)"),
        (["actor.lora.target_modules=[linear_qkv,q_proj]"], "actor.lora.target_modules", "linear_fc2"),
        (["actor.lora.target_modules=[]"], "actor.lora.target_modules", "expert layers are not adapted"),
        (["model.bridge_backend=megatron_bridge"], "model.bridge_backend", "LoRA"),
    ],
)
def test_bad_lora_setting_is_named(overrides, setting, words):
    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo", VALID + overrides, check_paths=False)
    lines = [v for v in err.value.violations if v.setting == setting]
    assert lines and words in lines[0].rule, err.value


def test_lora_defaults_are_valid_and_off_by_default():
    assert not load_config("tiny/grpo", ["model.path=unused"], check_paths=False).actor.lora.enable
    cfg = load_config("tiny/grpo", VALID + ["actor.lora.target_modules=[linear_qkv]"], check_paths=False)
    assert cfg.actor.lora.rank == 16 and list(cfg.actor.lora.target_modules) == ["linear_qkv"]


def test_lora_kl_needs_no_reference_layout():
    """The reference of a LoRA run is the actor with its adapters off: no reference engine, no layout to match."""
    tp2 = ["actor.use_kl_loss=true", "actor.megatron.tensor_model_parallel_size=2", "resources.n_gpus_per_node=2"]
    with pytest.raises(ConfigError, match=r"ref\.megatron\.tensor_model_parallel_size"):
        load_config("tiny/grpo", ["model.path=unused", *tp2], check_paths=False)
    assert load_config("tiny/grpo", VALID + tp2, check_paths=False).actor.use_kl_loss
