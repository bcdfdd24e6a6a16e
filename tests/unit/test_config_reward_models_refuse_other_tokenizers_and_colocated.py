"""Start-up rules of `reward.models`: a reward model whose tokenizer differs from the policy's is refused unless a
re-render is configured; placement colocated (not built yet), duplicate names and non-classifier folders are
refused, each naming the setting."""

import json

import pytest
from omegaconf import OmegaConf

from mrl.config.schema import MrlConfig
from mrl.config.startup.reward_rules import _reward_models
from mrl.data.synthetic import char_tokenizer
from mrl.models.tiny import make_tiny_reward_model, train_tiny_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_rules")
    policy = train_tiny_tokenizer()
    policy.save_pretrained(str(root / "policy"))
    make_tiny_reward_model("qwen2", root / "same", policy, num_hidden_layers=1)
    make_tiny_reward_model("qwen2", root / "other", char_tokenizer(), num_hidden_layers=1)
    (root / "lm").mkdir()
    (root / "lm" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    return {name: str(root / name) for name in ("policy", "same", "other", "lm")}


def violations(folders, *models, check_paths=True):
    cfg = OmegaConf.structured(MrlConfig)
    cfg.model.path = folders["policy"]
    cfg.merge_with({"reward": {"models": [{"name": f"rm{k}", **m} for k, m in enumerate(models)]}})
    return {(v.setting, str(v.value)): v.rule for v in _reward_models(cfg, check_paths)}


def test_same_tokenizer_in_a_pool_is_accepted(folders):
    assert violations(folders, {"path": folders["same"]}) == {}


def test_other_tokenizer_is_refused_unless_rerendered(folders):
    refused = violations(folders, {"path": folders["other"]})
    assert list(refused) == [("reward.models[0].rerender", "False")]
    assert "differs from the policy's" in refused[("reward.models[0].rerender", "False")]
    assert violations(folders, {"path": folders["other"], "rerender": True}) == {}


def test_colocated_duplicate_names_and_causal_lms_are_refused(folders):
    assert "not built yet" in violations(folders, {"path": folders["same"], "placement": "colocated"},
                                         check_paths=False)[("reward.models[0].placement", "colocated")]
    twice = violations(folders, {"path": folders["same"]}, {"path": folders["same"]}, check_paths=False)
    assert twice == {}  # distinct default names rm0, rm1
    cfg = OmegaConf.structured(MrlConfig)
    cfg.merge_with({"reward": {"models": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}})
    assert [v.setting for v in _reward_models(cfg, False)] == ["reward.models[0].name", "reward.models[1].name"]
    assert "one label" in violations(folders, {"path": folders["lm"], "rerender": True})[
        ("reward.models[0].path", folders["lm"])]
