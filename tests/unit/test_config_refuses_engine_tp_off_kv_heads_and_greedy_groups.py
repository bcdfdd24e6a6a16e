"""Start-up refuses, one line each naming the setting and the rule: an inference engine's TP (a replica's, or a PD
prefill / decode member's) that does not divide the model's key-value heads nor is a multiple of them, and greedy
sampling with several samples per prompt for a group estimator (every advantage would be 0)."""

import pytest

from mrl.config.startup import ConfigError, load_config, validate

VALID = ["model.path=unused", "data.max_prompt_length=64", "data.max_response_length=16"]
# 12 attention heads, 3 key-value heads: TP 2 and 4 divide the heads but split a KV head; TP 3 and 6 fit.
GQA = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 12, "num_key_value_heads": 3,
       "num_hidden_layers": 2, "vocab_size": 96, "max_position_embeddings": 4096}


def _lines(recipe: str, overrides: list[str], model: dict | None = None) -> list[str]:
    cfg = load_config(recipe, VALID + overrides, check=False)
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_paths=False, model_config=model)
    return err.value.lines()


def _accepts(recipe: str, overrides: list[str], model: dict | None = None) -> None:
    validate(load_config(recipe, VALID + overrides, check=False), check_paths=False, model_config=model)


@pytest.mark.parametrize("tp", [2, 4])
def test_rollout_tp_that_splits_a_kv_head_is_refused(tp):
    assert _lines("tiny/grpo", [f"rollout.tensor_model_parallel_size={tp}", "resources.n_gpus_per_node=12"], GQA) == [
        f"mrl: rollout.tensor_model_parallel_size={tp}: must divide the model's key-value heads (3) or be a "
        "multiple of them (each rank holds whole KV heads)"]


@pytest.mark.parametrize("tp", [1, 3, 6])
def test_rollout_tp_that_divides_or_replicates_kv_heads_is_accepted(tp):
    _accepts("tiny/grpo", [f"rollout.tensor_model_parallel_size={tp}", "resources.n_gpus_per_node=12"], GQA)


def test_pd_member_tp_is_checked_against_the_kv_heads():
    lines = _lines("tiny/grpo_pd", ["rollout.pd.prefill_tp=3", "rollout.pd.decode_tp=2", "resources.n_gpus_per_node=5"],
                   GQA)
    assert lines == ["mrl: rollout.pd.decode_tp=2: must divide the model's key-value heads (3) or be a multiple of "
                     "them (each rank holds whole KV heads)"]
    _accepts("tiny/grpo_pd", ["rollout.pd.prefill_tp=3", "rollout.pd.decode_tp=6", "resources.n_gpus_per_node=9"],
             GQA)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("setting,greedy", [("rollout.temperature", 0), ("rollout.top_k", 1)])
def test_greedy_sampling_with_several_samples_is_refused_for_group_estimators(estimator, setting, greedy):
    lines = _lines("tiny/grpo", [f"algorithm.adv_estimator={estimator}", f"{setting}={greedy}", "rollout.n=4"])
    assert lines == [f"mrl: {setting}={greedy}: greedy sampling gives a prompt's rollout.n=4 samples one response, "
                     f"so {estimator}'s group advantages are all 0: sample (temperature > 0, top_k -1 or > 1)"]


def test_greedy_sampling_is_accepted_with_one_sample_or_a_non_group_estimator():
    _accepts("tiny/grpo", ["rollout.temperature=0", "rollout.n=1"])
    _accepts("tiny/grpo", ["rollout.temperature=0", "algorithm.adv_estimator=reinforce_plus_plus"])
    _accepts("tiny/grpo", ["rollout.temperature=0.7", "rollout.top_k=2"])
