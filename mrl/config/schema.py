"""Typed configuration: one root dataclass registered with Hydra's ConfigStore.

Recipes (`recipes/<family>/<size>_<algo>.yaml`) start from `defaults: [mrl_config, _self_]` and override fields;
OmegaConf checks types and rejects unknown keys on composition. Cross-field rules (divisibility, mode/transport
compatibility, …) live in `mrl/config/validate.py` and run once at start-up, before any worker starts.
Field names follow verl's where a verl user would look for them (`ppo_mini_batch_size`, `rollout.n`, …).
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

ROOT_CONFIG_NAME = "mrl_config"


@dataclass
class ResourceConfig:
    """Devices of the trainer's pool. On a CPU-only machine each device slot is a CPU bundle."""

    nnodes: int = 1
    n_gpus_per_node: int = 1
    # Role workers sharing one device slot (actor, ref, critic, rollout in hybrid mode): each Ray worker asks for
    # 1 / max_colocate_count of a GPU so that they are placed on the same devices.
    max_colocate_count: int = 1


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    # Prompts per step (B). Each prompt is sampled rollout.n times.
    train_batch_size: int = 8
    val_batch_size: int | None = None
    shuffle: bool = True
    seed: int = 1
    # DAPO dynamic sampling: evict prompt groups whose rewards are all equal and generate more prompts, for at
    # most max_sample_rounds generation rounds per step.
    dynamic_sampling: bool = False
    max_sample_rounds: int = 4


@dataclass
class ModelConfig:
    # An HF folder (config.json + safetensors + tokenizer); no hub downloads.
    path: str = ""
    tokenizer_path: str | None = None
    # `mrl` is our own bridge layer; `megatron_bridge` uses NVIDIA Megatron-Bridge where it is installed.
    bridge_backend: str = "mrl"
    trust_remote_code: bool = False


@dataclass
class MegatronConfig:
    """Parallel layout and Megatron knobs of one engine (actor, reference or critic)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    recompute_granularity: str | None = None
    params_dtype: str = "float32"
    # Extra TransformerConfig fields passed through verbatim (for knobs without a named field here).
    override_transformer_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass
class ActorConfig:
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Prompts per optimizer update (M); updates per step = train_batch_size / ppo_mini_batch_size.
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size_per_gpu: int | None = 1
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 4096
    ppo_epochs: int = 1
    policy_loss: str = "ppo_clip"
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0


@dataclass
class RefConfig:
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    log_prob_micro_batch_size_per_gpu: int | None = 4


@dataclass
class CriticConfig:
    enable: bool = False
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size_per_gpu: int | None = 1
    cliprange_value: float = 0.5


@dataclass
class RolloutConfig:
    # Inference backend: vllm | sglang | trtllm | hf.
    name: str = "vllm"
    # Replica mode (DESIGN.md glossary): hybrid | colocated | standalone.
    mode: str = "hybrid"
    tensor_model_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    gpu_memory_utilization: float = 0.5
    # Devices of a standalone rollout pool (separate_async).
    nnodes: int = 0
    n_gpus_per_node: int = 0
    # Compute old log-probs with the trainer (False reuses the rollout engine's log-probs: "bypass").
    recompute_old_log_prob: bool = True
    enforce_eager: bool = True
    free_cache_engine: bool = True
    # Agent loops (mrl/rollout/agent_loop): single_turn | tool; CPU Ray actors running the sessions.
    agent_loop: str = "single_turn"
    agent_loop_workers: int = 1
    # Tool classes for the tool loop, as "package.module:Class".
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4
    # Replicas to start (0: as many as the trainer's device slots hold, one per TP×DP×PP footprint).
    num_replicas: int = 0
    # Extra engine arguments passed to the backend verbatim (e.g. vLLM's max_num_batched_tokens).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_coef: float = 0.001
    kl_ctrl_type: str = "fixed"
    kl_target: float = 0.1
    kl_horizon: int = 10000


@dataclass
class RewardConfig:
    # Registered rule-reward name or "module.path:function"; chosen per sample by data_source when "auto".
    reward_fn: str = "auto"
    num_workers: int = 4
    timeout_s: float = 10.0


@dataclass
class WeightSyncConfig:
    # ipc (same devices) | nccl (temporary group to a standalone pool; gloo on CPU) | disk (safetensors by path).
    transport: str = "ipc"
    bucket_size_mb: int = 512
    # separate_async: the rollout pool receives weights every parameter_sync_step optimizer updates.
    parameter_sync_step: int = 1
    staleness_threshold: int = 1
    timeout_s: float = 600.0


@dataclass
class TrainerConfig:
    # sync | colocate_async | separate_async (DESIGN.md glossary).
    mode: str = "sync"
    total_training_steps: int = 10
    total_epochs: int = 1
    seed: int = 1
    project_name: str = "mrl"
    experiment_name: str = "run"
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    resume_mode: str = "auto"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # Validation: greedy accuracy on data.val_files, plus pass@k with k temperature samples when val_pass_k > 0.
    val_pass_k: int = 0
    # Trajectories per step written to <default_local_dir>/rollouts.jsonl (0: no dump).
    rollout_dump_per_step: int = 8
    # Ray resources are declared from these, so a CPU-only machine can stand in for a GPU cluster.
    device: str = "auto"


@dataclass
class MrlConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


def register_configs() -> None:
    """Make `mrl_config` available to Hydra's defaults lists (idempotent)."""
    ConfigStore.instance().store(name=ROOT_CONFIG_NAME, node=MrlConfig)
