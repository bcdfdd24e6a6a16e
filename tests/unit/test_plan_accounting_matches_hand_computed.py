"""`mrl plan` reproduces the seeds' per-step accounting and a hand-computed memory estimate.

The two configurations are the seeds' groups A and B (verl's defaults: B=1024 prompts, M=256, 8 trainer GPUs,
rollout TP=2): colocated with n=1 reads 1024 requests / 4 updates / 4 replicas / 8 GPUs, and separate_async with
n=8 and a standalone pool of 4 GPUs reads 8192 / 4 / 2 / 12 with one cross-pool weight sync per step.
"""

import json

import pytest

from mrl.cli import main
from mrl.tools.plan import make_plan

GiB = 1024**3
SEED_DEFAULTS = [
    "resources.nnodes=1", "resources.n_gpus_per_node=8", "resources.max_colocate_count=3",
    "data.train_batch_size=1024", "actor.ppo_mini_batch_size=256", "actor.ppo_epochs=1",
    "rollout.tensor_model_parallel_size=2", "rollout.data_parallel_size=1", "rollout.pipeline_model_parallel_size=1",
]


def test_colocated_group_a_reads_1024_requests_4_updates_4_replicas_8_gpus():
    plan = make_plan("qwen3/8b_grpo", [*SEED_DEFAULTS, "rollout.n=1"])
    a = plan.accounting
    assert (a.prompts_per_step, a.rollout_requests, a.updates_per_step, a.rollout_replicas) == (1024, 1024, 4, 4)
    assert (a.training_devices, a.extra_rollout_devices, a.total_devices) == (8, 0, 8)
    assert a.mini_batch_samples == 256
    # Actor TP=2 on 8 GPUs: DP=4, so each device trains on 256 / 4 samples per update.
    assert (a.actor_dp, a.samples_per_device_per_update) == (4, 64)
    assert a.gpu_share_per_worker == pytest.approx(1 / 3)
    assert a.weight_syncs_per_step == 1 and not a.weight_sync_crosses_pools
    assert plan.can_start, plan.problems


def test_separate_async_group_b_reads_8192_requests_4_updates_2_replicas_12_gpus_and_syncs_across_pools():
    overrides = [*SEED_DEFAULTS, "rollout.n=8", "trainer.mode=separate_async", "rollout.mode=standalone",
                 "rollout.nnodes=1", "rollout.n_gpus_per_node=4", "weight_sync.transport=nccl",
                 "weight_sync.parameter_sync_step=4"]
    a = make_plan("qwen3/8b_grpo", overrides).accounting
    assert (a.rollout_requests, a.updates_per_step, a.rollout_replicas, a.total_devices) == (8192, 4, 2, 12)
    assert (a.rollout_devices, a.extra_rollout_devices) == (4, 4)
    # n multiplies the mini-batch too, so the update count does not change with n.
    assert (a.mini_batch_samples, a.samples_per_device_per_update) == (2048, 512)
    assert a.weight_syncs_per_step == 1 and a.weight_sync_crosses_pools
    assert a.requests_per_replica == 4096


def test_weight_syncs_follow_parameter_sync_step_and_epochs_multiply_updates():
    overrides = [*SEED_DEFAULTS, "rollout.n=8", "trainer.mode=separate_async", "rollout.mode=standalone",
                 "rollout.nnodes=1", "rollout.n_gpus_per_node=4", "weight_sync.transport=nccl",
                 "weight_sync.parameter_sync_step=2", "actor.ppo_mini_batch_size=512", "actor.ppo_epochs=2"]
    a = make_plan("qwen3/8b_grpo", overrides).accounting
    assert a.updates_per_step == 1024 / 512 * 2
    assert a.weight_syncs_per_step == 2


def _qwen3_8b_params() -> dict[str, int]:
    # Qwen3-8B's published shape: h=4096, 36 layers, 32 query / 8 KV heads of 128, MLP 12288, vocab 151936.
    h, heads, kv, hd, inter, vocab, layers = 4096, 32, 8, 128, 12288, 151936, 36
    layer = h * (heads * hd + 2 * kv * hd) + heads * hd * h + 2 * hd + 3 * h * inter + 2 * h
    return {"layers": layers * layer + h, "embedding": vocab * h}


def test_memory_estimate_matches_hand_computed_qwen3_8b_tp2_dp4_bf16():
    p = _qwen3_8b_params()
    plan = make_plan("qwen3/8b_grpo", [*SEED_DEFAULTS, "rollout.n=1", "actor.use_kl_loss=false"])
    assert plan.total_params == p["layers"] + 2 * p["embedding"]
    (actor,) = plan.memory.training
    per_device = (p["layers"] + 2 * p["embedding"]) / 2  # TP=2, PP=1: every layer and both vocab tables / 2
    assert actor.params == pytest.approx(2 * per_device)  # bf16
    assert actor.grads == pytest.approx(4 * per_device)  # fp32 gradient buffer
    assert actor.optimizer == pytest.approx(12 * per_device / 4)  # fp32 master + 2 moments over DP=4
    # Full recompute with SP: each layer keeps its 2-byte input, split over TP; 16384-token micro-batches.
    assert actor.activations == pytest.approx(2 * 16384 * 4096 / 2 * 36)
    r = plan.memory.rollout
    weights = 2 * plan.total_params / 2  # bf16 over rollout TP=2
    assert r.weights == pytest.approx(weights)
    assert r.kv_cache == pytest.approx(0.6 * 80 * GiB - weights - 2 * GiB)
    kv_per_token = 2 * 36 * 2 * (8 / 2) * 128  # K and V, 36 layers, bf16, 4 of 8 KV heads per TP rank
    assert r.kv_bytes_per_token == kv_per_token
    assert r.kv_tokens == int(r.kv_cache // kv_per_token)


def test_fp8_rollout_halves_the_engines_linear_weights_and_an_fp8_kv_cache_its_token_bytes():
    base = make_plan("qwen3/8b_grpo", SEED_DEFAULTS)
    fp8 = make_plan("qwen3/8b_grpo", [*SEED_DEFAULTS, "rollout.quantization=fp8", "trainer.device=cuda",
                                      "+rollout.engine_kwargs.kv_cache_dtype=fp8"])
    assert fp8.can_start, fp8.problems
    a, b = base.memory.rollout, fp8.memory.rollout
    # bf16 embeddings and output layer (2 × 151,936 × 4,096) stay; the linear weights go to a byte plus 1/4096 scales
    assert 0.55 < b.weights / a.weights < 0.6 and b.kv_cache == pytest.approx(a.kv_cache + a.weights - b.weights)
    assert b.kv_bytes_per_token * 2 == a.kv_bytes_per_token
    assert fp8.accounting.weight_sync_bytes == b.weights * 2  # the whole export, over rollout TP 2
    assert fp8.accounting.weight_sync_bytes < base.accounting.weight_sync_bytes


def test_kv_budget_at_or_below_zero_cannot_start():
    # 0.2 of 80 GiB is 16 GiB, short of 15.3 GiB of unsplit bf16 weights plus the 2 GiB runtime; of 141 GiB it fits.
    overrides = ["rollout.gpu_memory_utilization=0.2", "rollout.tensor_model_parallel_size=1"]
    plan = make_plan("qwen3/8b_grpo", overrides)
    assert not plan.can_start
    assert any("KV cache budget" in p for p in plan.problems)
    bigger = make_plan("qwen3/8b_grpo", overrides, device_gib=141)
    assert bigger.can_start, bigger.problems


def test_training_that_exceeds_device_memory_cannot_start():
    plan = make_plan("qwen3/8b_grpo", ["actor.megatron.tensor_model_parallel_size=1",
                                       "actor.megatron.use_distributed_optimizer=false",
                                       "actor.megatron.recompute_granularity=null"])
    assert any("training phase needs" in p for p in plan.problems)


def test_rollout_replica_larger_than_its_devices_cannot_start():
    plan = make_plan("qwen3/8b_grpo", ["rollout.tensor_model_parallel_size=16"])
    assert plan.accounting.rollout_replicas == 0
    assert any("must be a multiple of the replica footprint TP×DP×PP = 16" in p for p in plan.problems)
    # Asking for more replicas than the devices hold is the same problem.
    more = make_plan("qwen3/8b_grpo", ["rollout.num_replicas=5"])
    assert more.accounting.rollout_replicas == 5 and not more.can_start


def test_a_colocated_rollout_adds_its_reserve_to_the_training_phase():
    # Its own processes on the trainer's devices, never asleep: 0.6 × 80 GiB beside 44 GiB of training.
    plan = make_plan("qwen3/8b_grpo", ["rollout.mode=colocated"])
    assert any("colocated rollout keeps 48.0 GiB" in p for p in plan.problems)
    # It fits at a lower share, but `mrl train` places the policy's rollout hybrid or standalone only.
    lower = make_plan("qwen3/8b_grpo", ["rollout.mode=colocated", "rollout.gpu_memory_utilization=0.3"])
    assert [p.split(":")[1].strip() for p in lower.problems] == ["rollout.mode='colocated'"]


def test_start_up_rule_violations_are_problems_and_the_cli_exits_1(capsys):
    assert main(["plan", "qwen3/8b_grpo_separate_async", "weight_sync.parameter_sync_step=3"]) == 1
    out = capsys.readouterr().out
    assert "CANNOT START: config: weight_sync.parameter_sync_step=3" in out
    assert "rollout requests (B x n)          1024" in out


def test_cli_json_output_carries_the_accounting(capsys):
    assert main(["plan", "qwen3/8b_grpo", "--json", "--device-memory-gib", "141"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["can_start"] is True
    assert plan["accounting"]["updates_per_step"] == 4
    assert plan["memory"]["device_bytes"] == 141 * GiB


def test_the_critic_holds_a_value_head_instead_of_the_vocabulary_projection():
    p = _qwen3_8b_params()
    plan = make_plan("qwen3/8b_grpo", [*SEED_DEFAULTS, "rollout.n=1", "critic.enable=true",
                                       "critic.megatron.tensor_model_parallel_size=2",
                                       "critic.megatron.params_dtype=bfloat16"])
    critic = next(e for e in plan.memory.training if e.role == "critic")
    per_device = (p["layers"] + p["embedding"] + 4096 + 1) / 2  # the [4096 → 1] score head, not 151936 x 4096
    assert critic.params == pytest.approx(2 * per_device)
    assert critic.grads == pytest.approx(4 * per_device)


def test_a_distillation_teacher_counts_as_a_frozen_engine_on_the_references_layout():
    p = _qwen3_8b_params()
    base = [*SEED_DEFAULTS, "rollout.n=1", "actor.use_kl_loss=false", "ref.megatron.tensor_model_parallel_size=2",
            "ref.megatron.params_dtype=bfloat16", "algorithm.distill.enable=true"]
    plan = make_plan("qwen3/8b_grpo", [*base, "algorithm.distill.teacher_path=/ckpt/Qwen3-8B"])
    teacher = next(e for e in plan.memory.training if e.role == "teacher")
    assert teacher.params == pytest.approx(2 * (p["layers"] + 2 * p["embedding"]) / 2)  # bf16 over TP=2
    assert teacher.grads == teacher.optimizer == teacher.activations == 0  # forward-only
    assert plan.memory.training_total == pytest.approx(sum(e.total for e in plan.memory.training))
    bigger = make_plan("qwen3/8b_grpo", [*base, "algorithm.distill.teacher_path=/ckpt/Qwen3-30B-A3B"])
    assert next(e.params for e in bigger.memory.training if e.role == "teacher") > 3 * teacher.params
    unknown = make_plan("qwen3/8b_grpo", [*base, "algorithm.distill.teacher_path=/ckpt/no-such-model"])
    assert any(p.startswith("algorithm.distill.teacher_path: no config.json") for p in unknown.problems)


def test_a_colocated_reward_model_counts_as_a_frozen_value_model_on_the_references_layout():
    p = _qwen3_8b_params()
    base = [*SEED_DEFAULTS, "rollout.n=1", "actor.use_kl_loss=false", "ref.megatron.tensor_model_parallel_size=2",
            "ref.megatron.params_dtype=bfloat16"]
    rm = "reward.models=[{name:helpful,path:/ckpt/Qwen3-8B,placement:colocated}]"
    plan = make_plan("qwen3/8b_grpo", [*base, rm])
    model = next(e for e in plan.memory.training if e.role == "rm:helpful")
    assert model.params == pytest.approx(2 * (p["layers"] + p["embedding"] + 4096 + 1) / 2)  # score head, bf16/TP 2
    assert model.grads == model.optimizer == model.activations == 0  # forward-only
    assert [e.role for e in plan.memory.training] == ["actor", "rm:helpful"]
    pooled = make_plan("qwen3/8b_grpo", [*base, rm.replace("colocated", "pool")])
    assert [e.role for e in pooled.memory.training] == ["actor"]  # a pool's model is not on the trainer's devices
    unknown = make_plan("qwen3/8b_grpo", [*base, rm.replace("/ckpt/Qwen3-8B", "/ckpt/no-such-model")])
    assert any(p.startswith("reward.models[0].path: no config.json") for p in unknown.problems)
