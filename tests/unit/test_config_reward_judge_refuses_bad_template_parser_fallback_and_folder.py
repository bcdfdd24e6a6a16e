"""Start-up rules of a generative judge (`reward.models[i].kind: generative`): a template with unknown fields, a
regex parser without a group, a fallback that is not a finite number and an unreadable judge folder are each
refused in one line naming the setting and the rule; a well-formed judge starts."""

import os

import pytest
from omegaconf import OmegaConf

from mrl.config.schema import MrlConfig
from mrl.config.startup import ConfigError, load_config
from mrl.config.startup.reward_rules import _reward_models
from mrl.data.synthetic import char_tokenizer
from mrl.models.tiny import make_tiny_hf_model, make_tiny_reward_model

JUDGE = {"name": "judge", "kind": "generative", "template": "Q: {prompt}\nA: {response}\nScore:"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge_rules")
    tok = char_tokenizer()
    make_tiny_hf_model("qwen2", root / "judge", tokenizer=tok, vocab_size=len(tok), num_hidden_layers=1)
    make_tiny_reward_model("qwen2", root / "classifier", tok, num_hidden_layers=1)
    (root / "no_tokenizer").mkdir()
    (root / "no_tokenizer" / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    (root / "bad_json").mkdir()
    (root / "bad_json" / "config.json").write_text("{not json")
    return {name: str(root / name) for name in ("judge", "classifier", "no_tokenizer", "bad_json")}


def refused(folders, check_paths=True, **judge):
    cfg = OmegaConf.structured(MrlConfig)
    cfg.model.path = folders["judge"]  # the policy: a generative judge needs no shared tokenizer
    cfg.merge_with({"reward": {"models": [{**JUDGE, "path": folders["judge"], **judge}]}})
    return {v.setting: (str(v.value), v.rule) for v in _reward_models(cfg, check_paths)}


def test_a_well_formed_judge_is_accepted(folders):
    assert refused(folders) == {}
    assert refused(folders, parser="mrl.reward.judge:prompt_text", template="{response}") == {}


def test_template_with_an_unknown_field_is_refused(folders):
    value, rule = refused(folders, template="Q: {question}\nA: {response}")["reward.models[0].template"]
    assert value == "Q: {question}\nA: {response}"
    assert "unknown field(s) question" in rule and "{prompt}, {response}, {ground_truth}" in rule
    assert "must name {response}" in refused(folders, template="Q: {prompt}")["reward.models[0].template"][1]


def test_regex_without_a_group_is_refused(folders):
    value, rule = refused(folders, parser=r"Score: \d+")["reward.models[0].parser"]
    assert value == r"Score: \d+" and "needs a group" in rule
    assert "does not load" in refused(folders, parser="no_such_pkg.mod:parse")["reward.models[0].parser"][1]


def test_fallback_that_is_not_a_finite_number_is_refused(folders):
    for value in ("nan", "inf"):
        assert "a finite number" in refused(folders, fallback_score=value)["reward.models[0].fallback_score"][1]
    # A string is refused when the config is composed (the field is a float), in the same one-line form.
    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo", ["model.path=unused", "reward.models=[{name:j,kind:generative,template:'{response}',"
                                  "fallback_score:bad}]"], check_paths=False)
    assert [v.setting for v in err.value.violations] == ["reward.models[0].fallback_score"]
    assert "reward.models[0].fallback_score='bad': must be float" in str(err.value)


def test_unreadable_judge_folders_are_refused(folders, tmp_path):
    for name, says in (("missing", "No such file"), ("bad_json", "JSONDecodeError"),
                       ("no_tokenizer", "tokenizer loads")):
        path = folders.get(name, str(tmp_path / name))
        value, rule = refused(folders, path=path)["reward.models[0].path"]
        assert value == path and says in rule
    assert "kind=discriminative" in refused(folders, path=folders["classifier"])["reward.models[0].path"][1]
    if os.geteuid() != 0:  # root reads any folder
        locked = tmp_path / "locked"
        locked.mkdir()
        (locked / "config.json").write_text("{}")
        locked.chmod(0)
        try:
            assert "PermissionError" in refused(folders, path=str(locked))["reward.models[0].path"][1]
        finally:
            locked.chmod(0o755)


def test_unknown_kind_and_sampling_ranges_are_refused(folders):
    assert "one of discriminative" in refused(folders, check_paths=False, kind="judge")["reward.models[0].kind"][1]
    bad = refused(folders, check_paths=False, backend="tgi", max_new_tokens=0, temperature=-1.0, top_p=0.0)
    assert set(bad) == {"reward.models[0].backend", "reward.models[0].max_new_tokens",
                        "reward.models[0].temperature", "reward.models[0].top_p"}
