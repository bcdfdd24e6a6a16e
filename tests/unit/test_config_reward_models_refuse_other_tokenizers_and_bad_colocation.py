"""Start-up rules of `reward.models`: a reward model whose tokenizer differs from the policy's is refused unless a
re-render is configured; duplicate names and non-classifier folders are refused; placement colocated is accepted
for a discriminative model without re-render or dynamic sampling whose architecture has a bridge and whose shape
ref.megatron splits, and for a judge beside a hybrid rollout whose replicas fit on the trainer's devices and whose
memory share fits beside the rollout's; refused otherwise, each naming the setting."""

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
    make_tiny_reward_model("qwen2", root / "three_heads", policy, num_hidden_layers=1, hidden_size=48,
                           num_attention_heads=3, num_key_value_heads=1)
    (root / "lm").mkdir()
    (root / "lm" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    policy.save_pretrained(str(root / "gpt"))  # the policy's tokenizer: only the architecture is wrong
    (root / "gpt" / "config.json").write_text(json.dumps({"architectures": ["GPTBigCodeForSequenceClassification"],
                                                          "num_labels": 1}))
    return {name: str(root / name) for name in ("policy", "same", "other", "three_heads", "lm", "gpt")}


def violations(folders, *models, check_paths=True, **settings):
    cfg = OmegaConf.structured(MrlConfig)
    cfg.model.path = folders["policy"]
    for key, value in settings.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    cfg.merge_with({"reward": {"models": [{"name": f"rm{k}", **m} for k, m in enumerate(models)]}})
    return {(v.setting, str(v.value)): v.rule for v in _reward_models(cfg, check_paths)}


def test_same_tokenizer_in_a_pool_is_accepted(folders):
    assert violations(folders, {"path": folders["same"]}) == {}


def test_other_tokenizer_is_refused_unless_rerendered(folders):
    refused = violations(folders, {"path": folders["other"]})
    assert list(refused) == [("reward.models[0].rerender", "False")]
    assert "differs from the policy's" in refused[("reward.models[0].rerender", "False")]
    assert violations(folders, {"path": folders["other"], "rerender": True}) == {}


def test_duplicate_names_and_causal_lms_are_refused(folders):
    twice = violations(folders, {"path": folders["same"]}, {"path": folders["same"]}, check_paths=False)
    assert twice == {}  # distinct default names rm0, rm1
    cfg = OmegaConf.structured(MrlConfig)
    cfg.merge_with({"reward": {"models": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}})
    assert [v.setting for v in _reward_models(cfg, False)] == ["reward.models[0].name", "reward.models[1].name"]
    assert "one label" in violations(folders, {"path": folders["lm"], "rerender": True})[
        ("reward.models[0].path", folders["lm"])]


def colocated(folders, name, **m):
    return {"path": folders[name], "placement": "colocated", **m}


def test_a_colocated_classifier_of_the_policys_tokens_is_accepted(folders):
    assert violations(folders, colocated(folders, "same")) == {}


def test_a_colocated_judge_needs_a_hybrid_rollout_room_on_the_devices_and_a_memory_share(folders):
    def judge(check_paths=False, **settings):
        m = colocated(folders, "same", kind="generative", template="{response}")
        return violations(folders, {**m, **{k: v for k, v in settings.items() if "__" not in k}},
                          check_paths=check_paths, **{k: v for k, v in settings.items() if "__" in k})

    share = "reward.models[0].gpu_memory_utilization"
    assert judge(gpu_memory_utilization=0.3) == {}  # beside the rollout's default 0.5
    assert "set when colocated" in judge()[(share, "None")]
    assert "at most 0.25" in judge(gpu_memory_utilization=0.3, rollout__gpu_memory_utilization=0.7)[(share, "0.3")]
    standalone = judge(gpu_memory_utilization=0.3, rollout__mode="standalone")
    assert "unless rollout.mode=hybrid" in standalone[("reward.models[0].placement", "colocated")]
    crowded = judge(gpu_memory_utilization=0.3, num_replicas=2)
    assert "at most the trainer's 1 devices" in crowded[("reward.models[0].num_replicas", "2")]


def test_colocated_rerender_or_dynamic_sampling_is_refused(folders):
    rerender = violations(folders, colocated(folders, "other", rerender=True))
    assert list(rerender) == [("reward.models[0].rerender", "True")]
    assert "placement=colocated" in rerender[("reward.models[0].rerender", "True")]
    dynamic = violations(folders, colocated(folders, "same"), data__dynamic_sampling=True)
    assert list(dynamic) == [("data.dynamic_sampling", "True")] and "reward.models[0]" in dynamic[
        ("data.dynamic_sampling", "True")]


def test_colocated_without_a_bridge_or_whose_heads_ref_tp_cannot_split_is_refused(folders):
    gpt = violations(folders, colocated(folders, "gpt"))
    assert "'GPTBigCodeForSequenceClassification' has none" in gpt[("reward.models[0].path", folders["gpt"])]
    split = violations(folders, colocated(folders, "three_heads"), resources__n_gpus_per_node=2,
                       actor__megatron__tensor_model_parallel_size=2, ref__megatron__tensor_model_parallel_size=2)
    assert list(split) == [("ref.megatron.tensor_model_parallel_size", "2")]
    why = split[("ref.megatron.tensor_model_parallel_size", "2")]
    assert why.startswith(f"the reward model rm0 ({folders['three_heads']}): ") and "attention heads (3)" in why
    assert violations(folders, {"path": folders["three_heads"]}, ref__megatron__tensor_model_parallel_size=2) == {}
