"""`mrl train` refuses every invalid setting at start-up: exit code 2, one `mrl: <setting>=<value>: <rule>` line
naming the setting and the rule, no traceback, and no Ray or worker process started.

The matrix covers every field with a range or shape rule, every cross-field rule (the start-up table of
test_config_rejects_invalid_settings.py runs here too, through the command line), unknown keys and wrong types,
data files, free-form dict keys against the installed vLLM and megatron-core, and each recipe family's
model-shape rules against its model's real config.json. The command runs in this process: a case that got past
the rules would reach `init_ray`, which here fails the test instead of starting Ray.
"""

import json
import shutil

import psutil
import pytest
from test_config_rejects_invalid_settings import DENSE, INVALID, MOE, UNKNOWN

from mrl import cli
from mrl.config.startup.loader import RECIPES_DIR
from mrl.trainer import main as train_main

ODD_VOCAB = {**DENSE, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 9}
BASE = ["model.path={dense}", "data.train_files=[{train}]", "data.max_prompt_length=64",
        "data.max_response_length=16"]
FAMILY_BASE = ["model.path={family}", "data.train_files=[{prompts}]", "data.val_files=[]"]
FAMILY_MODELS = {"llama3/8b_grpo": "Llama-3.1-8B", "qwen2_5/7b_grpo": "Qwen2.5-7B", "qwen3/8b_grpo": "Qwen3-8B",
                 "qwen3_moe/30b_a3b_grpo": "Qwen3-30B-A3B", "qwen3_moe/235b_a22b_grpo": "Qwen3-235B-A22B",
                 "deepseek_v3/671b_grpo": "DeepSeek-V3"}
GAE = ["critic.enable=true", "algorithm.adv_estimator=gae"]
NO_KL = ["actor.use_kl_loss=false"]  # family cases change the actor alone (the reference must match it)
EVEN = ["actor.megatron.num_layers_in_first_pipeline_stage=null",  # PP 1: no uneven split
        "actor.megatron.num_layers_in_last_pipeline_stage=null"]
SEPARATE = ["trainer.mode=separate_async", "rollout.mode=standalone", "weight_sync.transport=nccl",
            "rollout.nnodes=1", "weight_sync.parameter_sync_step=2"]

# (overrides, setting, a fragment of the rule) on recipes/tiny/grpo.yaml with BASE.
TINY = [
    # ranges of single fields
    (["algorithm.gamma=1.5"], "algorithm.gamma", "must be in [0, 1]"),
    (["algorithm.gamma=-0.1"], "algorithm.gamma", "must be in [0, 1]"),
    (["algorithm.lam=2"], "algorithm.lam", "must be in [0, 1]"),
    (["algorithm.kl_coef=-0.1"], "algorithm.kl_coef", "must be >= 0"),
    (["actor.clip_ratio_low=1.0"], "actor.clip_ratio_low", "must be in [0, 1)"),
    (["actor.clip_ratio_high=-0.2"], "actor.clip_ratio_high", ">= 0"),
    (["actor.entropy_coeff=-0.01"], "actor.entropy_coeff", "must be >= 0"),
    (["actor.kl_loss_coef=-1"], "actor.kl_loss_coef", ">= 0"),
    (["critic.cliprange_value=-0.5"], "critic.cliprange_value", ">= 0"),
    (["ref.log_prob_micro_batch_size_per_gpu=0"], "ref.log_prob_micro_batch_size_per_gpu", "must be >= 1"),
    ([*GAE, "critic.ppo_micro_batch_size_per_gpu=0"], "critic.ppo_micro_batch_size_per_gpu", "must be >= 1"),
    ([*GAE, "critic.ppo_micro_batch_size_per_gpu=null"], "critic.ppo_micro_batch_size_per_gpu", "sample count"),
    (["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=0"], "actor.ppo_micro_batch_size_per_gpu",
     "must be >= 1 when"),
    (["actor.megatron.virtual_pipeline_model_parallel_size=0"], "actor.megatron.virtual_pipeline_model_parallel_size",
     "must be >= 1"),
    (["actor.megatron.expert_tensor_parallel_size=0"], "actor.megatron.expert_tensor_parallel_size", "must be >= 1"),
    (["critic.megatron.virtual_pipeline_model_parallel_size=-1"],
     "critic.megatron.virtual_pipeline_model_parallel_size", "must be >= 1"),
    (["ref.megatron.expert_tensor_parallel_size=0"], "ref.megatron.expert_tensor_parallel_size", "must be >= 1"),
    (["actor.megatron.tensor_model_parallel_size=0"], "actor.megatron.tensor_model_parallel_size", ">= 1"),
    (["actor.megatron.pipeline_model_parallel_size=0"], "actor.megatron.pipeline_model_parallel_size", ">= 1"),
    (["actor.megatron.context_parallel_size=0"], "actor.megatron.context_parallel_size", ">= 1"),
    (["actor.megatron.expert_model_parallel_size=0"], "actor.megatron.expert_model_parallel_size", ">= 1"),
    (["actor.megatron.logprob_chunk_tokens=0"], "actor.megatron.logprob_chunk_tokens", ">= 1"),
    (["rollout.num_replicas=-1"], "rollout.num_replicas", "must be >= 0"),
    (["rollout.nnodes=-1"], "rollout.nnodes", "must be >= 0"),
    (["rollout.n_gpus_per_node=-1"], "rollout.n_gpus_per_node", "must be >= 0"),
    (["rollout.tensor_model_parallel_size=0"], "rollout.tensor_model_parallel_size", ">= 1"),
    (["rollout.data_parallel_size=0"], "rollout.data_parallel_size", ">= 1"),
    (["rollout.pipeline_model_parallel_size=0"], "rollout.pipeline_model_parallel_size", ">= 1"),
    (["rollout.max_turns=0"], "rollout.max_turns", ">= 1"),
    (["rollout.agent_loop_workers=0"], "rollout.agent_loop_workers", ">= 1"),
    (["trainer.val_pass_k=-1"], "trainer.val_pass_k", "must be >= 0"),
    (["trainer.rollout_dump_per_step=-1"], "trainer.rollout_dump_per_step", "must be >= 0"),
    (["trainer.max_checkpoints_to_keep=0"], "trainer.max_checkpoints_to_keep", "must be >= 1"),
    (["trainer.total_training_steps=0"], "trainer.total_training_steps", ">= 1"),
    (["trainer.test_freq=0"], "trainer.test_freq", "-1 (never) or a positive"),
    (["trainer.save_freq=-2"], "trainer.save_freq", "-1 (never) or a positive"),
    (["data.max_prompt_length=0"], "data.max_prompt_length", ">= 1"),
    (["data.max_response_length=0"], "data.max_response_length", ">= 1"),
    (["resources.max_colocate_count=0"], "resources.max_colocate_count", ">= 1"),
    (["weight_sync.bucket_size_mb=0"], "weight_sync.bucket_size_mb", ">= 1"),
    (["weight_sync.parameter_sync_step=0"], "weight_sync.parameter_sync_step", ">= 1"),
    (["weight_sync.timeout_s=0"], "weight_sync.timeout_s", "> 0 seconds"),
    (["reward.num_workers=0"], "reward.num_workers", ">= 1"),
    (["rollout.request_retry_wait_s=0"], "rollout.request_retry_wait_s", "> 0 seconds"),
    (["rollout.health_check_timeout_s=-1"], "rollout.health_check_timeout_s", "> 0 seconds"),
    (["rollout.control_timeout_s=0"], "rollout.control_timeout_s", "> 0 seconds"),
    (["rollout.generate_timeout_s=0"], "rollout.generate_timeout_s", "> 0 seconds"),
    (["trainer.dispatch_timeout_s=0"], "trainer.dispatch_timeout_s", "> 0 seconds"),
    (["resources.start_timeout_s=-1"], "resources.start_timeout_s", "> 0 seconds"),
    (["rollout.max_request_retries=-1"], "rollout.max_request_retries", ">= 0"),
    (["rollout.max_replica_restarts=-1"], "rollout.max_replica_restarts", ">= 0"),
    (["rollout.health_check_interval_s=-1"], "rollout.health_check_interval_s", ">= 0"),
    (["rollout.max_num_seqs=0"], "rollout.max_num_seqs", ">= 1"),
    (["rollout.max_num_batched_tokens=-5"], "rollout.max_num_batched_tokens", ">= 1"),
    (["rollout.sleep_level=3"], "rollout.sleep_level", "must be one of 1, 2"),
    (["rollout.dtype=fp8"], "rollout.dtype", "must be one of float32, bfloat16, float16"),
    (["+rollout.engine_kwargs.gpu_memory_utilization=0.45"], "rollout.engine_kwargs.gpu_memory_utilization",
     "rollout.gpu_memory_utilization fills this engine argument"),
    (["rollout.name=sglang", "+rollout.engine_kwargs.extra_args=['--mem-fraction-static','0.4']"],
     "rollout.engine_kwargs.mem_fraction_static", "rollout.gpu_memory_utilization fills this engine argument"),
    # what the rollout backends can run as placed (each failed at the first sleep or weight sync)
    (["rollout.name=sglang", "rollout.sleep_level=1"], "rollout.sleep_level", "without --enable-weights-cpu-backup"),
    (["rollout.name=trtllm", "rollout.sleep_level=1"], "rollout.sleep_level", "come back with undefined content"),
    (["rollout.name=sglang", "resources.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2"],
     "rollout.tensor_model_parallel_size", "a sglang replica's server holds one device slot"),
    (["rollout.name=trtllm", "resources.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2"],
     "rollout.tensor_model_parallel_size", "a trtllm replica's server holds one device slot"),
    (["rollout.name=trtllm", "resources.n_gpus_per_node=2", "rollout.pipeline_model_parallel_size=2"],
     "rollout.pipeline_model_parallel_size", "a trtllm replica's server holds one device slot"),
    # the reward: a function that loads, a data_source with a function (once scored as math), its error budget
    (["reward.reward_fn=gsm8kk"], "reward.reward_fn", "data_source 'gsm8kk' has no reward function"),
    (["reward.reward_fn=no.such.module:fn"], "reward.reward_fn", "cannot be loaded"),
    (["data.train_files=[{unknown_source}]"], "data.train_files", "data_source 'my/task' has no reward function"),
    (["reward.max_error_rate=1.5"], "reward.max_error_rate", "must be in [0, 1]"),
    # optimizer fields and their shapes
    (["actor.optim.betas=[0.9]"], "actor.optim.betas", "two numbers"),
    (["critic.optim.betas=[0.9,0.99,0.999]"], "critic.optim.betas", "two numbers"),
    (["critic.optim.betas=[-0.1,0.9]"], "critic.optim.betas", "each be in [0, 1)"),
    (["actor.optim.lr=-1"], "actor.optim.lr", ">= 0"),
    (["actor.optim.weight_decay=-0.1"], "actor.optim.weight_decay", ">= 0"),
    (["actor.optim.clip_grad=-1"], "actor.optim.clip_grad", ">= 0"),
    (["actor.optim.lr_warmup_steps=-1"], "actor.optim.lr_warmup_steps", ">= 0"),
    (["critic.optim.min_lr=1"], "critic.optim.min_lr", "must be in [0, critic.optim.lr"),
    # unknown keys, '+' outside free-form dicts, wrong types
    (["rollout.nn=4"], "rollout.nn", "unknown setting; did you mean rollout.n?"),
    (["+actor.optim.learning_rate=1e-5"], "actor.optim.learning_rate", "did you mean actor.optim.lr?"),
    (["++actor.optim.lrr=3"], "actor.optim.lrr", "did you mean actor.optim.lr?"),
    (["+trainer.total_trainig_steps=3"], "trainer.total_trainig_steps", "did you mean trainer.total_training_steps?"),
    (["+rollout.n=3"], "rollout.n", "'+' adds keys only inside free-form dicts"),
    (["rollout.n=four"], "rollout.n", "must be int"),
    (["data.train_batch_size=1.5"], "data.train_batch_size", "must be int"),
    (["trainer.total_training_steps=ten"], "trainer.total_training_steps", "must be int or null"),
    (["actor.use_kl_loss=maybe"], "actor.use_kl_loss", "must be bool"),
    (["actor.optim=3"], "actor.optim", "must be OptimConfig"),
    (["rollout.n"], "rollout.n", "not a key=value override (missing EQUAL"),
    (["rollout.n=[1,"], "rollout.n", "not a key=value override"),
    (["=3"], "override", "names no setting"),
    # free-form dicts: keys the installed engine / Megatron / adapter accepts
    (["+rollout.engine_kwargs.max_num_seq=3"], "rollout.engine_kwargs.max_num_seq", "did you mean max_num_seqs?"),
    (["rollout.engine_kwargs.enable_prefix_cachin=true"], "rollout.engine_kwargs.enable_prefix_cachin",
     "did you mean enable_prefix_caching?"),
    (["rollout.name=hf", "+rollout.engine_kwargs.max_num_seqs=8"], "rollout.engine_kwargs.max_num_seqs",
     "the hf backend"),
    (["rollout.name=sglang", "+rollout.engine_kwargs.mem_fraction=0.5"], "rollout.engine_kwargs.mem_fraction",
     "the sglang adapter"),
    (["+actor.megatron.override_transformer_config.hiden_dropout=0.1"],
     "actor.megatron.override_transformer_config.hiden_dropout", "did you mean hidden_dropout?"),
    (["+critic.megatron.override_transformer_config.tensor_model_parallel_size=2"],
     "critic.megatron.override_transformer_config.tensor_model_parallel_size",
     "set critic.megatron.tensor_model_parallel_size instead"),
    # data files
    (["data.train_files=[]"], "data.train_files", "at least one training file"),
    (["data.train_files=[/no/such/train.parquet]"], "data.train_files", "no such file"),
    (["data.val_files=[/no/such/val.jsonl]"], "data.val_files", "no such file"),
    (["data.train_files=[{text}]"], "data.train_files", "unsupported format"),
    (["data.train_batch_size=32"], "data.train_batch_size", "more prompts than data.train_files hold (16 rows)"),
    # where the replicas go (the placement mrl plan and the runtime share)
    (["resources.n_gpus_per_node=3", "rollout.tensor_model_parallel_size=2"], "rollout.tensor_model_parallel_size",
     "must be a multiple of the replica footprint TP×DP×PP = 2"),
    (["resources.n_gpus_per_node=4", "rollout.pipeline_model_parallel_size=3"], "rollout.pipeline_model_parallel_size",
     "multiple of the replica footprint TP×DP×PP = 3"),
    (["resources.n_gpus_per_node=2", "rollout.data_parallel_size=2"], "rollout.data_parallel_size",
     "reaches the TP×PP workers of one engine"),
    (["rollout.mode=colocated"], "rollout.mode", "hybrid (on the trainer's devices) or standalone"),
    ([*SEPARATE, "rollout.n_gpus_per_node=3", "rollout.tensor_model_parallel_size=2"],
     "rollout.tensor_model_parallel_size", "the standalone pool's 3 device slots"),
    ([*SEPARATE, "rollout.n_gpus_per_node=1", "rollout.num_replicas=2"], "rollout.num_replicas",
     "exceed the standalone pool's 1 device slots"),
    # the model's 3 layers over 2 pipeline stages: even, or uneven with stages that hold them all
    (["resources.n_gpus_per_node=2", "actor.megatron.pipeline_model_parallel_size=2"],
     "actor.megatron.pipeline_model_parallel_size", "(or set num_layers_in_first/last_pipeline_stage"),
    (["resources.n_gpus_per_node=2", "actor.megatron.pipeline_model_parallel_size=2",
      "actor.megatron.num_layers_in_first_pipeline_stage=2", "actor.megatron.num_layers_in_last_pipeline_stage=2"],
     "actor.megatron.pipeline_model_parallel_size", "the other -1 of the model's 3 layers"),
    (["actor.megatron.num_layers_in_last_pipeline_stage=0"], "actor.megatron.num_layers_in_last_pipeline_stage",
     ">= 1"),
    (["actor.megatron.num_layers_in_first_pipeline_stage=1"], "actor.megatron.num_layers_in_first_pipeline_stage",
     "needs pipeline_model_parallel_size > 1"),
    # the model's vocabulary over TP: padded to a multiple of TP, but a rank would hold only padding
    (["model.path={odd_vocab}", "resources.n_gpus_per_node=4", "actor.megatron.tensor_model_parallel_size=4"],
     "actor.megatron.tensor_model_parallel_size", "vocabulary (9 tokens)"),
    ([*GAE, "model.path={odd_vocab}", "resources.n_gpus_per_node=4", "critic.megatron.tensor_model_parallel_size=4"],
     "critic.megatron.tensor_model_parallel_size", "vocabulary (9 tokens)"),
    # Megatron's make_vocab_size_divisible_by: 9 tokens padded to 32 rows at TP 2, so rank 1 holds rows 16-31
    (["model.path={odd_vocab}", "resources.n_gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2",
      "actor.megatron.make_vocab_size_divisible_by=16"], "actor.megatron.tensor_model_parallel_size",
     "multiple of 32 rows (make_vocab_size_divisible_by × TP)"),
    (["actor.megatron.make_vocab_size_divisible_by=0"], "actor.megatron.make_vocab_size_divisible_by", ">= 1"),
]

# (recipe, overrides, setting, rule) on each family's recipe with its model's config.json (FAMILY_BASE).
FAMILIES = [
    ("llama3/8b_grpo", [*NO_KL, "resources.n_gpus_per_node=12", "actor.megatron.tensor_model_parallel_size=3"],
     "actor.megatron.tensor_model_parallel_size", "attention heads (32)"),
    ("llama3/8b_grpo", [*NO_KL, "actor.megatron.expert_model_parallel_size=2"],
     "actor.megatron.expert_model_parallel_size", "no experts (dense)"),
    ("qwen2_5/7b_grpo", [*NO_KL, "actor.megatron.tensor_model_parallel_size=8"],
     "actor.megatron.tensor_model_parallel_size", "attention heads (28) and key-value heads (4)"),
    ("qwen2_5/7b_grpo", ["resources.n_gpus_per_node=12", "rollout.tensor_model_parallel_size=3",
                         "actor.megatron.tensor_model_parallel_size=1", "ref.megatron.tensor_model_parallel_size=1",
                         "actor.megatron.sequence_parallel=false", "ref.megatron.sequence_parallel=false"],
     "rollout.tensor_model_parallel_size", "must divide the model's attention heads (28)"),
    ("qwen3/8b_grpo", [*NO_KL, "actor.megatron.tensor_model_parallel_size=1", "actor.megatron.sequence_parallel=false",
                       "actor.megatron.pipeline_model_parallel_size=8"],
     "actor.megatron.pipeline_model_parallel_size", "must divide the model's 36 layers"),
    ("qwen3/8b_grpo", ["data.max_response_length=40000", "actor.ppo_max_token_len_per_gpu=65536"],
     "data.max_response_length", "exceeds the model's context (max_position_embeddings = 40960)"),
    ("qwen3_moe/30b_a3b_grpo", [*NO_KL, "resources.nnodes=1", "resources.n_gpus_per_node=12",
                                "actor.megatron.expert_model_parallel_size=12",
                                "ref.megatron.expert_model_parallel_size=4"],  # unused, but a valid layout
     "actor.megatron.expert_model_parallel_size", "routed experts (128)"),
    ("qwen3_moe/30b_a3b_grpo", [*NO_KL, "actor.megatron.sequence_parallel=false"],
     "actor.megatron.sequence_parallel", "sequence parallel for MoE with TP > 1"),
    ("qwen3_moe/235b_a22b_grpo", ["actor.megatron.pipeline_model_parallel_size=16",
                                  "actor.megatron.expert_model_parallel_size=8"],
     "actor.megatron.pipeline_model_parallel_size", "the model's 94 layers"),
    ("qwen3_moe/235b_a22b_grpo", ["actor.megatron.tensor_model_parallel_size=128",
                                  "actor.megatron.pipeline_model_parallel_size=1",
                                  "actor.megatron.expert_model_parallel_size=1", *EVEN],
     "actor.megatron.tensor_model_parallel_size", "attention heads (64)"),
    ("deepseek_v3/671b_grpo", ["resources.nnodes=12", "actor.megatron.pipeline_model_parallel_size=1",
                               "actor.megatron.expert_model_parallel_size=96", *EVEN],
     "actor.megatron.expert_model_parallel_size", "routed experts (256)"),
    ("deepseek_v3/671b_grpo", ["actor.megatron.sequence_parallel=false"],
     "actor.megatron.sequence_parallel", "sequence parallel for MoE with TP > 1"),
]

RECIPE_FILE = "defaults:\n  - mrl_config\n  - _self_\ntrainer:\n  total_trainig_steps: 3\n"


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for name, hf in (("dense", DENSE), ("moe", MOE), ("unknown", UNKNOWN), ("odd_vocab", ODD_VOCAB)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(hf))
        out[name] = str(root / name)
    for model in FAMILY_MODELS.values():
        (root / model).mkdir()
        shutil.copy(next(RECIPES_DIR.glob(f"*/models/{model}.json")), root / model / "config.json")
    (root / "train.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n' * 16)  # one batch
    (root / "unknown_source.jsonl").write_text('{"prompt": "hi", "data_source": "my/task"}\n' * 16)
    (root / "prompts.jsonl").write_text('{"prompt": "hi"}\n' * 512)  # a family recipe's batch
    (root / "train.txt").write_text("hi\n")
    (root / "typo.yaml").write_text(RECIPE_FILE)
    out.update(train=str(root / "train.jsonl"), unknown_source=str(root / "unknown_source.jsonl"),
               prompts=str(root / "prompts.jsonl"), text=str(root / "train.txt"),
               typo=str(root / "typo.yaml"),
               root=str(root))
    return out


@pytest.fixture
def no_ray(monkeypatch):
    """A case that passed every rule would start Ray here: fail it instead."""
    import ray

    def tripwire(*_, **__):
        raise AssertionError("the start-up rules let this configuration through: Ray would start now")

    monkeypatch.setattr(train_main, "init_ray", tripwire)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    assert not ray.is_initialized()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, "a process was started"


def _with_base(base: list[str], overrides: list[str]) -> list[str]:
    keys = {o.lstrip("+").split("=")[0] for o in overrides}
    return [o for o in base if o.split("=")[0] not in keys] + overrides


# (recipe, base, overrides, setting, rule, the only line). The start-up table's cases were written for the setting
# to be among the violations, and a few of them break two rules at once: there the named line must be one of them.
CASES = [("tiny/grpo", BASE, o, s, r, False) for o, s, r in INVALID] + [
    ("tiny/grpo", BASE, o, s, r, True) for o, s, r in TINY
] + [
    (recipe, [o.replace("{family}", "{root}/" + FAMILY_MODELS[recipe]) for o in FAMILY_BASE], overrides, s, r, True)
    for recipe, overrides, s, r in FAMILIES
] + [
    ("{typo}", ["model.path={dense}", "data.train_files=[{train}]"], [], "trainer.total_trainig_steps",
     "did you mean trainer.total_training_steps?", True),
    ("tiny/nope", [], [], "recipe", "not found", True),
]


@pytest.mark.parametrize(("recipe", "base", "overrides", "setting", "rule", "alone"), CASES,
                         ids=[f"{c[0]}:{c[3]}:{i}" for i, c in enumerate(CASES)])
def test_each_invalid_setting_is_one_line_and_exit_2_before_any_process(paths, no_ray, capsys, recipe, base,
                                                                        overrides, setting, rule, alone):
    _refused_in_one_line(paths, capsys, recipe, base, overrides, setting, rule, alone)


# (overrides, setting, rule) on tiny/grpo with BASE where TransformerEngine is importable (faked: it is not
# installed on the CPU machines), so the engines would build TE layers.
WITH_TE = [
    (["resources.n_gpus_per_node=2", "actor.megatron.context_parallel_size=2"], "actor.megatron.context_parallel_size",
     "context parallel is not built yet"),
    (["actor.lora.enable=true"], "actor.lora.enable", "which LoRA does not wrap yet"),
]


@pytest.mark.parametrize(("overrides", "setting", "rule"), WITH_TE, ids=[c[1] for c in WITH_TE])
def test_each_setting_te_layers_cannot_run_is_refused_before_any_process(paths, no_ray, capsys, monkeypatch,
                                                                         overrides, setting, rule):
    from mrl.config.startup import backend_rules

    monkeypatch.setattr(backend_rules, "transformer_engine_importable", lambda: True)
    _refused_in_one_line(paths, capsys, "tiny/grpo", BASE, overrides, setting, rule, True)


def _refused_in_one_line(paths: dict[str, str], capsys: pytest.CaptureFixture, recipe: str, base: list[str],
                         overrides: list[str], setting: str, rule: str, alone: bool) -> None:
    given = [o.format(**paths) for o in _with_base(base, overrides)]
    code = cli.main(["train", recipe.format(**paths), *given])
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if not ln.startswith("mrl: hid ")]  # the warnings summary
    assert code == 2, captured
    assert "Traceback" not in captured.err + captured.out and all(ln.startswith("mrl: ") for ln in lines), lines
    named = [ln for ln in lines if ln.startswith(f"mrl: {setting}=") and rule in ln]
    assert named, lines
    assert len(lines) == 1 or not alone, lines


def test_the_matrix_holds_at_least_100_invalid_settings():
    assert len(CASES) >= 100 and len({(c[0], c[3], c[4]) for c in CASES}) >= 100


def test_a_valid_run_gets_past_the_rules_to_ray(paths, monkeypatch):
    started = []
    monkeypatch.setattr(train_main, "init_ray", lambda *a, **k: started.append(a) or (_ for _ in ()).throw(
        SystemExit(0)))
    with pytest.raises(SystemExit):
        cli.main(["train", "tiny/grpo", *[o.format(**paths) for o in BASE]])
    assert started  # the BASE the cases start from is valid: each case's line is its own setting's


def test_an_uneven_pipeline_split_that_holds_every_layer_gets_past_the_rules(paths, monkeypatch):
    """3 layers over PP 2 as 1 + 2 (Megatron's num_layers_in_first_pipeline_stage) is accepted."""
    started = []
    monkeypatch.setattr(train_main, "init_ray", lambda *a, **k: started.append(a) or (_ for _ in ()).throw(
        SystemExit(0)))
    split = ["resources.n_gpus_per_node=2", "actor.megatron.pipeline_model_parallel_size=2",
             "actor.megatron.num_layers_in_first_pipeline_stage=1"]
    with pytest.raises(SystemExit):
        cli.main(["train", "tiny/grpo", *[o.format(**paths) for o in BASE], *split])
    assert started


def test_mrl_train_needs_a_recipe(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train"])
    assert exit_info.value.code == 2 and "recipe" in capsys.readouterr().err


def test_a_debug_run_keeps_the_traceback(paths, monkeypatch):
    from mrl.config import ConfigError

    monkeypatch.setenv("MRL_DEBUG", "1")
    with pytest.raises(ConfigError, match=r"algorithm\.gamma"):
        cli.main(["config", "tiny/grpo", *[o.format(**paths) for o in BASE], "algorithm.gamma=2"])


@pytest.mark.parametrize(("argv", "line"), [
    (["config", "tiny/grpo", "rollout.nn=4"], "mrl: rollout.nn=4: unknown setting; did you mean rollout.n?"),
    (["plan", "qwen3/8b_grpo", "+actor.optim.learning_rate=1e-5"],
     "mrl: actor.optim.learning_rate=1e-05: unknown setting; did you mean actor.optim.lr?"),
    (["plan", "tiny/grpo", "model.path=/no/model"], "mrl: no config.json for '/no/model'"),
    (["report", "/no/run"], "mrl: run_dir='/no/run/metrics.jsonl': no metrics file there"),
])
def test_every_command_speaks_the_same_error_style(no_ray, capsys, argv, line):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[0].startswith(line), err
