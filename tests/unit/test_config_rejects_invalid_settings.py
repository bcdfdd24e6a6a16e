"""The configuration root composes recipes with types checked, and start-up validation names setting and rule."""

import json

import pytest

from mrl.config.startup import ConfigError, load_config

VALID = ["model.path=unused", "data.max_prompt_length=64", "data.max_response_length=16"]


def _violations(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo", VALID + overrides, check_paths=False)
    return [v.setting for v in err.value.violations]


def test_tiny_recipe_composes_and_validates():
    cfg = load_config("tiny/grpo", VALID, check_paths=False)
    assert cfg.rollout.n == 4 and cfg.trainer.mode == "sync"
    assert cfg.trainer.default_local_dir == "runs/mrl/tiny_grpo"  # interpolation resolved at load


DENSE = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 6, "num_key_value_heads": 2,
         "num_hidden_layers": 3, "max_position_embeddings": 128}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 4,
       "num_hidden_layers": 2, "num_experts": 6, "max_position_embeddings": 4096}
UNKNOWN = {**DENSE, "architectures": ["GPTBigCodeForCausalLM"]}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Model folders holding only a config.json: the start-up rules read shapes from it, nothing else."""
    root = tmp_path_factory.mktemp("model_configs")
    folders = {}
    for name, hf in (("dense", DENSE), ("moe", MOE), ("unknown", UNKNOWN)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(hf))
        folders[name] = str(root / name)
    (root / "train.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n' * 16)  # one batch
    folders["train"] = str(root / "train.jsonl")
    return folders


# (overrides, the setting named, a fragment of the rule); run by the command-line matrix (see below).
# `{dense}` / `{moe}` / `{unknown}`: a model folder whose config.json the rule reads (TP vs heads, EP vs experts,
# PP vs layers, architecture vs bridges, context length).
INVALID = [
    # batch sizes: updates per step, micro-batches, token budgets
    (["actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size", "must divide data.train_batch_size"),
    (["data.train_batch_size=0"], "data.train_batch_size", ">= 1"),
    (["critic.enable=true", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"],
     "critic.ppo_mini_batch_size", "must divide data.train_batch_size"),
    (["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=null"],
     "actor.ppo_micro_batch_size_per_gpu", "must be >= 1 when actor.use_dynamic_bsz is false"),
    (["actor.ppo_max_token_len_per_gpu=32"], "actor.ppo_max_token_len_per_gpu", "must hold the longest sample"),
    (["actor.ppo_epochs=0"], "actor.ppo_epochs", ">= 1"),
    (["rollout.n=0"], "rollout.n", ">= 1"),
    (["resources.cpu_threads_per_slot=-1"], "resources.cpu_threads_per_slot", ">= 0"),
    # parallel layouts against the devices and the model
    (["resources.n_gpus_per_node=3", "actor.megatron.tensor_model_parallel_size=2"],
     "actor.megatron.tensor_model_parallel_size", "must divide the trainer's devices"),
    (["resources.n_gpus_per_node=2", "actor.megatron.expert_model_parallel_size=4"],
     "actor.megatron.expert_model_parallel_size", "must divide the devices of one pipeline stage"),
    (["actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "actor.megatron.virtual_pipeline_model_parallel_size", "need pipeline_model_parallel_size > 1"),
    (["resources.n_gpus_per_node=2", "actor.megatron.context_parallel_size=2"],
     "actor.megatron.context_parallel_size", "TransformerEngine"),
    (["actor.megatron.sequence_parallel=true"], "actor.megatron.sequence_parallel", "tensor_model_parallel_size > 1"),
    (["model.path={dense}", "resources.n_gpus_per_node=4", "actor.megatron.tensor_model_parallel_size=4"],
     "actor.megatron.tensor_model_parallel_size", "must divide the model's attention heads (6)"),
    (["model.path={dense}", "resources.n_gpus_per_node=4", "critic.megatron.tensor_model_parallel_size=4"],
     "critic.megatron.tensor_model_parallel_size", "key-value heads (2)"),
    (["model.path={dense}", "resources.n_gpus_per_node=2", "actor.megatron.pipeline_model_parallel_size=2"],
     "actor.megatron.pipeline_model_parallel_size", "must divide the model's 3 layers"),
    (["model.path={moe}", "resources.n_gpus_per_node=4", "actor.megatron.expert_model_parallel_size=4"],
     "actor.megatron.expert_model_parallel_size", "must divide the model's routed experts (6)"),
    (["model.path={dense}", "resources.n_gpus_per_node=2", "actor.megatron.expert_model_parallel_size=2"],
     "actor.megatron.expert_model_parallel_size", "no experts (dense)"),
    (["model.path={moe}", "resources.n_gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2"],
     "actor.megatron.sequence_parallel", "sequence parallel for MoE with TP > 1"),
    (["model.path={dense}", "rollout.name=vllm", "resources.n_gpus_per_node=4", "rollout.tensor_model_parallel_size=4"],
     "rollout.tensor_model_parallel_size", "must divide the model's attention heads"),
    (["actor.use_kl_loss=true", "resources.n_gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2"],
     "ref.megatron.tensor_model_parallel_size", "shares the actor's processes"),
    # rollout backends and modes
    (["rollout.name=hf", "resources.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2"],
     "rollout.tensor_model_parallel_size", "the hf rollout backend runs one process"),
    (["rollout.name=sglang", "resources.n_gpus_per_node=2", "rollout.pipeline_model_parallel_size=2"],
     "rollout.pipeline_model_parallel_size", "refuses pipeline parallel"),
    (["rollout.mode=standalone", "weight_sync.transport=nccl"], "rollout.mode", "needs trainer.mode=separate_async"),
    (["rollout.mode=standalone", "trainer.mode=separate_async", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"],
     "weight_sync.transport", "use nccl or disk, not ipc"),
    (["trainer.mode=separate_async", "rollout.mode=standalone", "weight_sync.transport=nccl", "rollout.nnodes=1",
      "rollout.n_gpus_per_node=1", "weight_sync.parameter_sync_step=3"],
     "weight_sync.parameter_sync_step", "parameter_sync_step × actor.ppo_mini_batch_size"),
    (["trainer.mode=separate_async", "rollout.mode=standalone", "weight_sync.transport=nccl"],
     "rollout.nnodes", "needs a rollout pool with device slots"),
    (["trainer.mode=colocate_async", "rollout.mode=colocated"], "rollout.mode", "needs rollout.mode=hybrid"),
    (["trainer.mode=colocate_async", "weight_sync.staleness_threshold=-1"], "weight_sync.staleness_threshold",
     ">= 0"),  # the async modes' own table: tests/unit/test_config_async_modes_reject_each_violation.py
    (["rollout.num_replicas=2"], "rollout.num_replicas", "exceed the trainer's 1 device slots"),
    (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization", "must be in (0, 1]"),
    (["rollout.max_num_batched_tokens=0"], "rollout.max_num_batched_tokens", "must be >= 1"),
    (["+rollout.engine_kwargs.max_num_batched_tokens=64"], "rollout.engine_kwargs.max_num_batched_tokens",
     "rollout.max_num_batched_tokens fills this engine argument"),
    (["rollout.top_p=0"], "rollout.top_p", "must be in (0, 1]"),
    (["rollout.top_k=0"], "rollout.top_k", "-1 (disabled)"),
    (["rollout.temperature=-1"], "rollout.temperature", ">= 0"),
    (["rollout.tools=[my_tools.Calculator]"], "rollout.tools", "'package.module:Class'"),
    # names that select code
    (["trainer.mode=fastest"], "trainer.mode", "must be one of"),
    (["rollout.name=tgi"], "rollout.name", "must be one of"),
    (["weight_sync.transport=rdma"], "weight_sync.transport", "must be one of"),
    (["weight_sync.one_copy=true", "weight_sync.transport=disk"], "weight_sync.one_copy",
     "needs weight_sync.transport=ipc"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator", "must be one of"),
    (["actor.policy_loss=dpo"], "actor.policy_loss", "must be one of"),
    (["actor.loss_agg_mode=sum"], "actor.loss_agg_mode", "must be one of"),
    (["critic.loss_agg_mode=sum"], "critic.loss_agg_mode", "must be one of"),
    (["actor.kl_loss_type=js"], "actor.kl_loss_type", "must be one of"),
    (["actor.megatron.params_dtype=fp8"], "actor.megatron.params_dtype", "must be one of"),
    (["actor.megatron.logprob_keep_logits_gib=-1"], "actor.megatron.logprob_keep_logits_gib", "must be >= 0"),
    (["actor.optim.lr_decay_style=step"], "actor.optim.lr_decay_style", "must be one of"),
    (["trainer.device=tpu"], "trainer.device", "must be one of"),
    # optimizer and loss ranges
    (["actor.optim.lr=1e-3", "actor.optim.min_lr=1e-2"], "actor.optim.min_lr", "must be in [0, actor.optim.lr"),
    (["actor.optim.betas=[0.9,1.0]"], "actor.optim.betas", "must each be in [0, 1)"),
    (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c", "must be > 1"),
    (["actor.clip_ratio_low=-0.1"], "actor.clip_ratio_low", "must be in [0, 1)"),
    # run, model and data
    (["model.path="], "model.path", "must name an HF model folder"),
    (["model.path={unknown}"], "model.path", "'GPTBigCodeForCausalLM' has no bridge"),
    (["model.path={dense}", "data.max_response_length=100"], "data.max_response_length",
     "exceeds the model's context"),
    (["model.trust_remote_code=true"], "model.trust_remote_code", "not loaded"),
    (["trainer.save_freq=0"], "trainer.save_freq", "-1 (never) or a positive"),
    (["trainer.resume_mode=/no/such/global_step_3"], "trainer.resume_mode", "complete checkpoint folder"),
    (["reward.timeout_s=0"], "reward.timeout_s", "> 0 seconds"),
    (["reward.models=[{{name:rm,path:unused,placement:nearby}}]"], "reward.models[0].placement", "'colocated'"),
    (["reward.models=[{{name:rm,path:unused,placement:colocated,rerender:true}}]"], "reward.models[0].rerender",
     "placement=colocated"),
    (["algorithm.distill.enable=true"], "algorithm.distill.teacher_path", "enable=true needs one"),
    (["algorithm.distill.enable=true", "algorithm.distill.teacher_path={dense}", "algorithm.distill.mode=alone",
      "algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward", "with algorithm.distill.mode=alone"),
    (["algorithm.distill.enable=true", "algorithm.distill.teacher_path={dense}", "resources.n_gpus_per_node=2",
      "actor.megatron.tensor_model_parallel_size=2"], "ref.megatron.tensor_model_parallel_size",
     "distillation teacher"),
    (["algorithm.distill.mode=both"], "algorithm.distill.mode", "one of add, alone"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator", "critic.enable=true"),
    (["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=pid"], "algorithm.kl_ctrl_type", "must be one of"),
    (["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k9"], "algorithm.kl_penalty", "must be one of"),
    (["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=adaptive", "algorithm.kl_target=0"],
     "algorithm.kl_target", "adaptive KL controller needs it > 0"),
    (["algorithm.use_kl_in_reward=true", "resources.n_gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2"],
     "ref.megatron.tensor_model_parallel_size", "shares the actor's processes"),
    # loggers and run length
    (["trainer.logger=[console,mlflow]"], "trainer.logger", "unknown logger 'mlflow'"),
    (["trainer.total_epochs=0"], "trainer.total_epochs", ">= 1"),
    (["data.val_batch_size=0"], "data.val_batch_size", ">= 1"),
    (["trainer.peak_tflops_per_device=0"], "trainer.peak_tflops_per_device", "must be > 0"),
    # MoE router replay
    (["actor.megatron.router_replay=r3"], "actor.megatron.router_replay", "must be one of"),
    (["model.path={dense}", "rollout.name=hf", "actor.megatron.router_replay=rollout"],
     "actor.megatron.router_replay", "the model is dense"),
    (["model.path={moe}", "rollout.name=vllm", "actor.megatron.router_replay=rollout"],
     "actor.megatron.router_replay", "rollout.name=vllm needs vLLM on CUDA"),
    (["model.path={moe}", "rollout.name=hf", "actor.megatron.router_replay=old_log_prob",
      "actor.megatron.recompute_granularity=full"], "actor.megatron.router_replay", "full activation recompute"),
    (["model.path={moe}", "actor.megatron.router_replay=old_log_prob", "rollout.recompute_old_log_prob=false"],
     "actor.megatron.router_replay", "R2 records the routing in the old-log-prob pass"),
    (["ref.megatron.router_replay=rollout"], "ref.megatron.router_replay", "only actor.megatron.router_replay"),
]


# Each case runs through `mrl train` in test_cli_refuses_each_invalid_setting_in_one_line_before_any_process.py
# (exit code 2, its `mrl:` line, no process started), with that file's own cases.


def test_the_matrix_holds_at_least_30_distinct_rules():
    assert len({(setting, rule) for _, setting, rule in INVALID}) >= 30


def test_a_model_that_fits_every_rule_is_accepted(models):
    load_config("tiny/grpo", [f"model.path={models['dense']}", f"data.train_files=[{models['train']}]",
                              "resources.n_gpus_per_node=2",
                              "actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true",
                              "data.max_prompt_length=64", "data.max_response_length=64"])


def test_separate_async_constraints_reported_together():
    settings = _violations(["trainer.mode=separate_async"])
    assert {"rollout.mode", "rollout.nnodes", "rollout.n_gpus_per_node",
            "weight_sync.parameter_sync_step"} <= set(settings)


def test_separate_async_valid_when_constraints_hold():
    load_config("tiny/grpo", VALID + ["trainer.mode=separate_async", "rollout.mode=standalone", "rollout.nnodes=1",
                                      "rollout.n_gpus_per_node=1", "weight_sync.transport=nccl",
                                      "weight_sync.parameter_sync_step=2"], check_paths=False)


def test_message_names_setting_value_and_rule():
    with pytest.raises(ConfigError, match=r"actor\.ppo_mini_batch_size=5: must divide data\.train_batch_size=16"):
        load_config("tiny/grpo", [*VALID, "actor.ppo_mini_batch_size=5"], check_paths=False)


def test_unknown_key_and_wrong_type_fail_on_composition():
    with pytest.raises(ConfigError, match=r"rollout\.nn=4: unknown setting; did you mean rollout\.n\?"):
        load_config("tiny/grpo", ["rollout.nn=4"], check=False)
    with pytest.raises(ConfigError, match=r"rollout\.n='four': must be int"):
        load_config("tiny/grpo", ["rollout.n=four"], check=False)


def test_missing_model_folder_is_reported(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.path"):
        load_config("tiny/grpo", [f"model.path={tmp_path}"])


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(FileNotFoundError, match=r"tiny/grpo"):
        load_config("tiny/nope")


def test_kl_in_reward_with_an_adaptive_controller_is_accepted():
    cfg = load_config("tiny/grpo", [*VALID, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=adaptive",
                                    "algorithm.kl_penalty=low_var_kl", "trainer.logger=[console,tensorboard,wandb]"],
                      check_paths=False)
    assert cfg.algorithm.use_kl_in_reward and list(cfg.trainer.logger) == ["console", "tensorboard", "wandb"]
