"""Start-up rules of `algorithm.distill`: enabling it needs a teacher folder that exists and is a causal LM with a
bridge; a teacher whose tokenizer differs from the student's is refused (it would score other tokens), and so is
one without a tokenizer to compare; its shape must fit ref.megatron, the layout its engine runs on (beside the actor);
mode alone refuses the settings only a task advantage reads; a teacher on replicas of its own needs a backend with
prompt log-probs and rollout.temperature 1. Each refusal is one line naming the setting."""

import json

import pytest
from omegaconf import OmegaConf

from mrl.config.schema import MrlConfig
from mrl.config.startup.reward_rules import _distill
from mrl.data.synthetic import char_tokenizer
from mrl.models.tiny import make_tiny_hf_model, train_tiny_tokenizer

TEACHER = "algorithm.distill.teacher_path"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_rules")
    student = train_tiny_tokenizer()
    student.save_pretrained(str(root / "student"))
    make_tiny_hf_model("qwen2", root / "same", tokenizer=student, num_hidden_layers=1)
    make_tiny_hf_model("qwen2", root / "other", tokenizer=char_tokenizer(), num_hidden_layers=1)
    make_tiny_hf_model("qwen2", root / "bare", tokenizer=False, num_hidden_layers=1)
    # three attention heads: TP 2 cannot split them
    make_tiny_hf_model("qwen2", root / "three_heads", tokenizer=student, num_hidden_layers=1, hidden_size=48,
                       num_attention_heads=3, num_key_value_heads=1)
    (root / "gpt").mkdir()
    (root / "gpt" / "config.json").write_text(json.dumps({"architectures": ["GPTBigCodeForCausalLM"]}))
    (root / "classifier").mkdir()  # a reward model's architecture: its causal LM has a bridge, but it has no lm_head
    (root / "classifier" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    return {p.name: str(p) for p in root.iterdir()}


def refused(folders, teacher: str | None, check_paths: bool = True, **settings) -> dict[str, str]:
    """{setting: its rules, joined by " | "} of the violations of a run distilling from the folder `teacher`."""
    cfg = OmegaConf.structured(MrlConfig)
    cfg.model.path = folders["student"]
    cfg.algorithm.distill.enable = True
    if teacher is not None:
        cfg.algorithm.distill.teacher_path = folders.get(teacher, teacher)
    for key, value in settings.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    out: dict[str, str] = {}
    for v in _distill(cfg, check_paths):
        out[v.setting] = f"{out[v.setting]} | {v.rule}" if v.setting in out else v.rule
    return out


def test_a_teacher_with_the_students_tokenizer_is_accepted(folders):
    assert refused(folders, "same") == {}


def test_enabled_without_a_teacher_or_with_a_missing_folder_is_refused(folders):
    assert "enable=true needs one" in refused(folders, None, check_paths=False)[TEACHER]
    assert "config.json" in refused(folders, "/no/such/teacher")[TEACHER]
    assert refused(folders, "/no/such/teacher", check_paths=False) == {}  # `mrl plan`: the folder is elsewhere


def test_a_teacher_with_another_vocabulary_or_none_to_compare_is_refused(folders):
    other = refused(folders, "other")
    assert list(other) == [TEACHER] and "differs" in other[TEACHER] and folders["student"] in other[TEACHER]
    assert "tokenizer loads" in refused(folders, "bare")[TEACHER]


def test_a_teacher_without_a_bridge_or_whose_heads_tp_cannot_split_is_refused(folders):
    assert "'GPTBigCodeForCausalLM' has none" in refused(folders, "gpt")[TEACHER]
    assert "a causal LM with a bridge" in refused(folders, "classifier")[TEACHER]
    split = refused(folders, "three_heads", resources__n_gpus_per_node=2,
                    actor__megatron__tensor_model_parallel_size=2, ref__megatron__tensor_model_parallel_size=2)
    assert list(split) == ["ref.megatron.tensor_model_parallel_size"]
    assert split["ref.megatron.tensor_model_parallel_size"].startswith(f"the teacher ({folders['three_heads']}): ")
    assert "attention heads (3)" in split["ref.megatron.tensor_model_parallel_size"]


def test_mode_alone_refuses_what_only_the_task_advantage_reads(folders):
    alone = refused(folders, "same", algorithm__distill__mode="alone", algorithm__use_kl_in_reward=True,
                    critic__enable=True)
    assert set(alone) == {"algorithm.use_kl_in_reward", "critic.enable"}
    assert refused(folders, "same", algorithm__distill__mode="add", algorithm__use_kl_in_reward=True,
                   critic__enable=True) == {}
    assert "one of add, alone" in refused(folders, "same", algorithm__distill__mode="both")["algorithm.distill.mode"]


def test_a_teacher_on_replicas_of_its_own_needs_prompt_log_probs_at_temperature_1(folders):
    pool = {"algorithm__distill__placement": "pool", "rollout__temperature": 1.0}
    assert refused(folders, "same", **pool) == {}
    # its own engine serves it: no bridge and no ref.megatron layout of the trainer's is needed
    assert "tokenizer loads" in refused(folders, "gpt", **pool)[TEACHER]  # its one complaint: no bridge is asked
    assert refused(folders, "three_heads", **pool, resources__n_gpus_per_node=2,
                   actor__megatron__tensor_model_parallel_size=2, ref__megatron__tensor_model_parallel_size=2) == {}
    tempered = refused(folders, "same", **{**pool, "rollout__temperature": 0.8})
    assert list(tempered) == ["rollout.temperature"]
    assert "untempered prompt log-probs" in tempered["rollout.temperature"]
    assert refused(folders, "same", **pool, algorithm__distill__backend="sglang") == {}
    trtllm = refused(folders, "same", **pool, algorithm__distill__backend="trtllm")
    assert list(trtllm) == ["algorithm.distill.backend"] and "prompt log-probs" in trtllm["algorithm.distill.backend"]
    assert "one of colocated, pool" in refused(folders, "same", algorithm__distill__placement="remote")[
        "algorithm.distill.placement"]
    assert "differs" in refused(folders, "other", **pool)[TEACHER]  # the vocabulary rule holds in a pool too
