"""Typed configuration: one root dataclass registered with Hydra's ConfigStore.

Recipes (`recipes/<family>/<size>_<algo>.yaml`) start from `defaults: [mrl_config, _self_]` and override fields;
OmegaConf checks types and rejects unknown keys on composition. Cross-field rules (divisibility, mode/transport
compatibility, …) live in `mrl/config/startup/validate.py` and run once at start-up, before any worker starts.
Field names follow verl's where a verl user would look for them (`ppo_mini_batch_size`, `rollout.n`, …).
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from mrl.config.reward_schema import DistillConfig, RewardConfig

ROOT_CONFIG_NAME = "mrl_config"
# trainer.logger's choices (mrl/trainer/loggers.py builds them; the start-up rules check the names).
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


@dataclass
class ResourceConfig:
    """Devices of the trainer's pool. On a CPU-only machine each device slot is a CPU bundle."""

    # Nodes of the trainer's pool.
    nnodes: int = 1
    # Device slots per node of the trainer's pool (GPUs; CPU bundles on a CPU-only machine).
    n_gpus_per_node: int = 1
    # Role workers sharing one device slot (actor, ref, critic, rollout in hybrid mode): each Ray worker asks for
    # 1 / max_colocate_count of a GPU so that they are placed on the same devices.
    max_colocate_count: int = 1
    # CPU-only hosts: compute (intra-op) threads of the trainer's workers on a device slot. 0 picks them: where the
    # rollout is hybrid, training and generation take turns on a slot, so the workers use the node's cores divided
    # by its slots; otherwise 1 (the engines run beside them). Ignored on GPU hosts (1 thread per worker).
    cpu_threads_per_slot: int = 0
    # Seconds the pool's placement groups may take to be reserved, and then its training workers to start (process
    # start and imports: a minute or more on a loaded host), before start-up fails naming the pool and its shares.
    start_timeout_s: float = 300.0


@dataclass
class DataConfig:
    # Training prompts: parquet (the common RL layout: prompt, data_source, reward_model.ground_truth, extra_info) or
    # JSONL.
    train_files: list[str] = field(default_factory=list)
    # Held-out prompts for validation (greedy accuracy, pass@k); same formats as train_files.
    val_files: list[str] = field(default_factory=list)
    # Column holding the chat messages of a prompt.
    prompt_key: str = "prompt"
    # Prompt tokens (after the chat template) beyond which a row is skipped.
    max_prompt_length: int = 512
    # Generated tokens per response (the rollout's max_tokens, also capped by the context length).
    max_response_length: int = 512
    # Prompts per step (B). Each prompt is sampled rollout.n times.
    train_batch_size: int = 8
    # Prompts per validation generation call (None: the whole val split at once).
    val_batch_size: int | None = None
    # Shuffle the training prompts every epoch.
    shuffle: bool = True
    # Seed of the prompt order.
    seed: int = 1
    # DAPO dynamic sampling: evict prompt groups whose rewards are all equal and generate more prompts, for at
    # most max_sample_rounds generation rounds per step.
    dynamic_sampling: bool = False
    # Generation rounds per step at most when dynamic_sampling refills evicted groups.
    max_sample_rounds: int = 4


@dataclass
class ModelConfig:
    # An HF folder (config.json + safetensors + tokenizer); no hub downloads.
    path: str = ""
    # Tokenizer folder when it is not model.path.
    tokenizer_path: str | None = None
    # `mrl` is our own bridge layer; `megatron_bridge` uses NVIDIA Megatron-Bridge where it is installed.
    bridge_backend: str = "mrl"
    # Must stay false: custom HF modelling code is never loaded (bridges map known architectures only), so true is
    # refused at start-up.
    trust_remote_code: bool = False


@dataclass
class MegatronConfig:
    """Parallel layout and Megatron knobs of one engine (actor, reference or critic)."""

    # Tensor parallel size (TP): attention heads and MLP columns split over TP ranks.
    tensor_model_parallel_size: int = 1
    # Pipeline parallel size (PP): layers split over PP stages (1F1B schedule).
    pipeline_model_parallel_size: int = 1
    # Model chunks per pipeline stage for the interleaved schedule (needs PP > 1).
    virtual_pipeline_model_parallel_size: int | None = None
    # Uneven pipeline stages (Megatron's TransformerConfig fields): the layers of the first / last stage, the middle
    # stages splitting the rest evenly (DeepSeek-V3's 61 layers at PP 8: 7 + 6 × 8 + 6). None: an even split.
    num_layers_in_first_pipeline_stage: int | None = None
    # Layers of the last pipeline stage (uneven split, as num_layers_in_first_pipeline_stage); None: an even share.
    num_layers_in_last_pipeline_stage: int | None = None
    # Megatron's make_vocab_size_divisible_by: the embedding and output layer hold the vocabulary rounded up to a
    # multiple of this × TP (128 gives GEMM-friendly shapes; Megatron-LM's default). The padded rows never leave
    # the trainer: exports cut them, log-probs put no mass on them. 1: pad only to a multiple of TP.
    make_vocab_size_divisible_by: int = 1
    # Context parallel size (CP): not built yet, so above 1 it is refused at start-up (without TransformerEngine
    # it cannot run; with it, packing does not split sequences over CP ranks and losses are scaled over DP only).
    context_parallel_size: int = 1
    # Expert parallel size (EP): MoE experts split over EP ranks.
    expert_model_parallel_size: int = 1
    # Tensor parallel size inside experts (ETP); None uses TP.
    expert_tensor_parallel_size: int | None = None
    # Sequence parallelism with TP (activations split along the sequence; required for MoE with TP > 1).
    sequence_parallel: bool = False
    # Shard optimizer state over DP (Megatron's distributed optimizer).
    use_distributed_optimizer: bool = True
    # Activation recomputation: None, 'full' or 'selective'.
    recompute_granularity: str | None = None
    # Parameter dtype of the engine: float32, bfloat16 or float16; the rollout engine's too unless rollout.dtype is
    # set (verl's default is bf16: "Defaults that differ from verl" below).
    params_dtype: str = "float32"
    # GiB per rank the log-prob path may spend keeping a micro-batch's logits (parameter dtype) for the backward
    # pass; a larger micro-batch recomputes the vocabulary projection there instead; 0 always recomputes.
    logprob_keep_logits_gib: float = 4.0
    # Tokens per chunk of the vocab-parallel log-prob/entropy pass: bounds the logits the forward pass holds at
    # once (4096 measured fastest on an H200; smaller chunks lower peak memory).
    logprob_chunk_tokens: int = 4096
    # torch.compile'd fused kernels without TE or apex: Megatron's SwiGLU and residual-add fusions, the RMSNorm
    # and the log-prob's elementwise work (one kernel each way). None: on CUDA, off on CPU (eager, no compile
    # time). On a 2-core CPU, 50M bf16 model: forward+backward 7% faster, after ~10 s of compiling in each
    # process's first step (cached on disk).
    compile_fusions: bool | None = None
    # Extra TransformerConfig fields passed through verbatim (for knobs without a named field here).
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    # Hybrid mode: which training state leaves the device while the rollout engine generates (copied to pinned
    # host memory and back; the caching allocator's blocks are released either way). Keep on the device what
    # fits beside the engine's reservation: every offloaded byte crosses PCIe twice per step.
    param_offload: bool = True
    # Gradient buffers (main_grad, fp32), as param_offload.
    grad_offload: bool = True
    # Optimizer state (Adam moments and fp32 master weights, 12 bytes per parameter), as param_offload.
    optimizer_offload: bool = True
    # MoE routing replay: 'none'; 'rollout' (R3: the old-log-prob, reference and update passes route every token
    # to the experts the rollout engine chose; needs a rollout backend that returns routed experts: hf, or vllm on
    # GPU); 'old_log_prob' (R2: the update replays the routing recorded in the old-log-prob pass). MoE models only.
    router_replay: str = "none"


@dataclass
class OptimConfig:
    # Peak learning rate (Adam).
    lr: float = 1e-6
    # Learning rate at the end of decay.
    min_lr: float = 0.0
    # Decoupled weight decay.
    weight_decay: float = 0.01
    # Gradient-norm clipping threshold.
    clip_grad: float = 1.0
    # Linear warm-up steps (optimizer updates).
    lr_warmup_steps: int = 0
    # Megatron's decay style after warm-up: constant, linear, cosine, inverse-square-root.
    lr_decay_style: str = "constant"
    # Adam's (beta1, beta2).
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass
class LoRAConfig:
    """Low-rank adapters on the actor's parallel linear layers (mrl/engine/megatron/lora.py)."""

    # Train adapters instead of every weight: the base is frozen (no gradients, no optimizer state) and the
    # reference policy is the same model with its adapters switched off (no second copy of the weights).
    enable: bool = False
    # Adapter rank r (> 0): A is [r, in], B is [out, r].
    rank: int = 16
    # Scale of the adapter's output is alpha / rank (> 0).
    alpha: float = 32.0
    # Dropout on the adapter's input while training, in [0, 1); 0 keeps the training forward equal to the
    # log-prob passes (RL compares them).
    dropout: float = 0.0
    # Megatron layers that get adapters: linear_qkv, linear_proj (attention), linear_fc1, linear_fc2 (dense MLP;
    # the experts' fc1/fc2 are not adapted).
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    # Seed of the adapters' A initialisation (Kaiming-uniform, as PEFT); B starts at zero, so step 0 is the base.
    init_seed: int = 0
    # How a weight sync reaches the engines: `merged` sends W + (alpha / rank)·B A through weight_sync (every
    # backend, transport and layout; generation runs at base-model speed); `adapter` writes only A and B as an HF
    # PEFT folder per version and loads it through vLLM's LoRA support (megabytes per sync instead of the whole
    # model, but each generated token pays the LoRA kernels): rollout.name=vllm only.
    sync: str = "merged"
    # Folder of the adapter-mode PEFT folders (one per version, the previous one deleted); empty: a fresh folder
    # under /dev/shm (tmpfs). Every rollout server must see it: one node.
    adapter_dir: str = ""


@dataclass
class ActorConfig:
    # Parallel layout of the actor.
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    # Optimizer of the actor.
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Prompts per optimizer update (M); updates per step = train_batch_size / ppo_mini_batch_size.
    ppo_mini_batch_size: int = 4
    # Samples per micro-batch when use_dynamic_bsz is False.
    ppo_micro_batch_size_per_gpu: int | None = 1
    # Pack micro-batches by token budget (ppo_max_token_len_per_gpu) instead of by sample count.
    use_dynamic_bsz: bool = False
    # Token budget of one packed micro-batch per device (dynamic batch size).
    ppo_max_token_len_per_gpu: int = 4096
    # Passes over each step's samples.
    ppo_epochs: int = 1
    # With ppo_epochs 1 and several updates per step, the first update trains on the weights π_old is computed
    # with: take its π_old from its own forward and skip its rows in the old log-prob pass (1/updates of the pass;
    # not with KL in reward, which reads π_old first). false: π_old of every row from the old log-prob pass.
    on_policy_first_update: bool = True
    # Policy loss: ppo_clip (dual clip), gspo or cispo (gspo keeps loss_agg_mode and the clip ratios as set: see
    # "Defaults that differ from verl" below).
    policy_loss: str = "ppo_clip"
    # Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm.
    loss_agg_mode: str = "token-mean"
    # C of seq-mean-token-sum-norm (Dr. GRPO): each sequence's token sum is divided by it (and by the sequence
    # count); null: data.max_response_length (verl's default). A constant of the run, as Dr. GRPO requires.
    loss_scale_factor: float | None = None
    # PPO clip range below 1 (epsilon_low).
    clip_ratio_low: float = 0.2
    # PPO clip range above 1 (epsilon_high; raise it for DAPO's clip-higher).
    clip_ratio_high: float = 0.2
    # Dual-clip bound c for negative advantages (> 1).
    clip_ratio_c: float = 3.0
    # Add a KL(actor || reference) term to the actor loss (starts the reference policy).
    use_kl_loss: bool = False
    # Weight of the KL loss term.
    kl_loss_coef: float = 0.001
    # KL estimator of the loss term: kl (k1), abs, mse (k2), low_var_kl (k3, clamped).
    kl_loss_type: str = "low_var_kl"
    # Entropy bonus weight (0: none).
    entropy_coeff: float = 0.0
    # LoRA adapters instead of full fine-tuning.
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class RefConfig:
    # Parallel layout of the reference policy (and of a distillation teacher and colocated reward models). Its
    # params_dtype follows the actor's unless set: a float32 teacher beside a bf16 actor took 6x the bf16 pass over
    # the same tokens on an H100 (docs/reward_models.md).
    megatron: MegatronConfig = field(
        default_factory=lambda: MegatronConfig(params_dtype="${actor.megatron.params_dtype}"))
    # Samples per micro-batch for reference log-probs.
    log_prob_micro_batch_size_per_gpu: int | None = 4


@dataclass
class CriticConfig:
    # Train a critic (the policy's transformer under a [hidden → 1] score head, HF's ...ForTokenClassification with
    # one label, read from model.path where it has one); needed by adv_estimator=gae.
    enable: bool = False
    # Parallel layout of the critic. Its params_dtype follows the actor's unless set, as the reference's does (a
    # float32 engine beside a bf16 actor took 6x the bf16 time on an H100: docs/reward_models.md).
    megatron: MegatronConfig = field(
        default_factory=lambda: MegatronConfig(params_dtype="${actor.megatron.params_dtype}"))
    # Optimizer of the critic.
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    # Prompts per critic update.
    ppo_mini_batch_size: int = 4
    # Samples per critic micro-batch.
    ppo_micro_batch_size_per_gpu: int | None = 1
    # Value clipping range around the old values.
    cliprange_value: float = 0.5
    # Value-loss aggregation (the critic's own, not the actor's): token-mean, seq-mean-token-sum,
    # seq-mean-token-mean, seq-mean-token-sum-norm.
    loss_agg_mode: str = "token-mean"


@dataclass
class PDConfig:
    # Prefill/decode-disaggregated replicas (mrl/rollout/pd.py): each replica is one prefill server and n_decode
    # decode servers passing KV caches over transfer_backend, on prefill_tp + decode_tp × n_decode device slots.
    enabled: bool = False
    # Tensor parallel size of the prefill member (its first slots).
    prefill_tp: int = 1
    # Tensor parallel size of each decode member (the slots after the prefill member's).
    decode_tp: int = 1
    # Decode members per replica; the router sends each session to one of them.
    n_decode: int = 1
    # KV transfer: nixl | mooncake (vLLM's KV connectors; SGLang's disaggregation backends).
    transfer_backend: str = "nixl"
    # First port of the members' side channels (vLLM's NIXL handshake, SGLang's bootstrap); replica r uses the
    # ports from base_port + 16 × r.
    base_port: int = 5600


@dataclass
class RolloutConfig:
    # Inference backend: vllm | sglang | trtllm | hf.
    name: str = "vllm"
    # Replica mode (DESIGN.md glossary): hybrid | colocated | standalone.
    mode: str = "hybrid"
    # Tensor parallel size of one inference replica.
    tensor_model_parallel_size: int = 1
    # Data parallel size inside one inference replica.
    data_parallel_size: int = 1
    # Pipeline parallel size of one replica (refused for backends without PP).
    pipeline_model_parallel_size: int = 1
    # Samples per prompt (multiplies samples, not optimizer updates).
    n: int = 1
    # Sampling temperature (0: greedy).
    temperature: float = 1.0
    # Nucleus sampling threshold in (0, 1].
    top_p: float = 1.0
    # Top-k sampling (-1: off).
    top_k: int = -1
    # Generate data.max_response_length tokens whatever the model samples (EOS does not stop a response): fixed
    # lengths for benchmarks; training runs leave it off.
    ignore_eos: bool = False
    # Seed every request (trainer.seed, the step or group and the sample's index): the same run samples the same
    # tokens. False leaves the draws to the engine's own generator. Why turn it off: vLLM's V1 sampler draws the
    # noise of seeded requests one request at a time (a 0.5B engine, 256 requests: 1.36x the tokens/s unseeded,
    # 3.5 ms per decode step, on an H100; tools/bench/seeded_sampling.py), and vLLM 0.25 keeps MoE models other than
    # Qwen2-MoE, DeepSeek-V2 and Granite-MoE, and runs with R3, on V1 (the MoE recipes turn seeds off); its V2
    # runner (dense models) draws all rows at once, and seeds cost nothing there. Start-up logs a note when seeds
    # meet the V1 runner on CUDA.
    seed_requests: bool = True
    # Fraction of device memory the inference engine may take (weights + KV cache): vLLM gpu_memory_utilization,
    # SGLang --mem-fraction-static, TensorRT-LLM kv_cache_config.free_gpu_memory_fraction (a share of the memory
    # left after its weights). CPU engines size their KV cache by VLLM_CPU_KVCACHE_SPACE instead.
    gpu_memory_utilization: float = 0.5
    # Engine dtype (float32, bfloat16, float16); None: actor.megatron.params_dtype, the dtype the sync sends.
    dtype: str | None = None
    # Weights the engine generates with: null (rollout.dtype) or fp8 (vllm only: blockwise FP8, 128×128 blocks with
    # one fp32 scale each; the trainer quantises each linear weight as the sync sends it, norms, embeddings, the
    # output layer and routers stay in rollout.dtype; the engine starts from a block-FP8 copy of model.path in the
    # system temp folder; docs/fp8.md).
    quantization: str | None = None
    # Block scales of rollout.quantization=fp8: fp32 (any value; the engine runs DeepGEMM, where present, with fp32
    # scales: VLLM_USE_DEEP_GEMM_E8M0=0) or ue8m0 (powers of two, DeepGEMM's E8M0 format, vLLM's default on Hopper
    # and Blackwell; Blackwell's DeepGEMM needs it). Either way the engine holds the quantised export bit for bit.
    fp8_scale_format: str = "fp32"
    # The engine's block-FP8 GEMM: deepgemm (vLLM's default on Hopper and Blackwell: JIT kernels, compiled for each
    # GEMM shape while the engine starts) or cutlass (VLLM_USE_DEEP_GEMM=0: vLLM's precompiled CUTLASS block-scaled
    # GEMM, or its Triton one where CUTLASS lacks the device; no JIT warm-up, the scales are never re-quantised).
    fp8_gemm: str = "deepgemm"
    # Reuse the KV cache of shared prompt prefixes (vLLM prefix caching, SGLang radix cache, TensorRT-LLM block
    # reuse); the cache is cleared after every weight sync, so hits are within one version's requests.
    enable_prefix_caching: bool = True
    # Allocate the engine's memory from a pool that sleep can release (vLLM sleep mode, SGLang memory saver,
    # TensorRT-LLM enable_sleep). None: on for engines on GPUs (on CPU there is nothing to release).
    enable_sleep_mode: bool | None = None
    # Sleep level of a hybrid replica while the trainer has the devices: 2 discards weights and KV cache (the
    # weight sync that follows every step refills the weights: nothing is copied to the host); 1 keeps a host copy
    # of the weights (for a wake-up that no full sync follows).
    sleep_level: int = 2
    # Sequences an engine runs at once (vLLM max_num_seqs, SGLang --max-running-requests, TensorRT-LLM
    # max_batch_size); None: the engine's default (vLLM on CPU: 256).
    max_num_seqs: int | None = None
    # Tokens an engine step may schedule (vLLM max_num_batched_tokens, SGLang --chunked-prefill-size, TensorRT-LLM
    # max_num_tokens); None: the engine's default (vLLM on CPU: max_num_seqs × context length, so that no prefill
    # is chunked: vLLM-CPU's seeded sampling cannot rewind a chunked prefill's generator).
    max_num_batched_tokens: int | None = None
    # Devices of a standalone rollout pool (separate_async).
    nnodes: int = 0
    # Device slots per node of the standalone rollout pool.
    n_gpus_per_node: int = 0
    # Compute old log-probs with the trainer (False reuses the rollout engine's log-probs: "bypass", which measures
    # no trainer-vs-rollout mismatch, so the rollout/* mismatch metrics are absent).
    recompute_old_log_prob: bool = True
    # Run the inference engine eagerly: no CUDA graphs (vLLM, SGLang, TensorRT-LLM) and no torch.compile (vLLM).
    # None: the engine's device default, graphs on GPU and eager on CPU, where vLLM's compile costs ~35 s per
    # engine start (cached across starts) for ~12% faster decoding of a 50M model.
    enforce_eager: bool | None = None
    # Hybrid replicas sleep during training (weights and KV cache released, both restored by the weight sync);
    # False keeps the engine resident on the devices and updates its weights in place.
    free_cache_engine: bool = True
    # Agent loops (mrl/rollout/agent_loop): single_turn | tool | a custom loop as "package.module:Name" (an
    # AgentLoop subclass or an async function returning a Trajectory); CPU Ray actors running the sessions.
    agent_loop: str = "single_turn"
    # Agent-loop Ray actors.
    agent_loop_workers: int = 1
    # Tool classes for the tool loop, as "package.module:Class".
    tools: list[str] = field(default_factory=list)
    # Turns per trajectory in the tool loop.
    max_turns: int = 4
    # Tool-call parser of the tool loop: hermes (`<tool_call>{json}</tool_call>`, Hermes/Qwen) or
    # "package.module:Class" with `parse(text) -> list[ToolCall]`.
    tool_parser: str = "hermes"
    # Tool calls per trajectory; later calls are answered with an error observation (the model may still answer).
    max_tool_calls: int = 8
    # Replicas to start (0: as many as the trainer's device slots hold, one per TP×DP×PP footprint).
    num_replicas: int = 0
    # Extra engine arguments passed to the backend verbatim (e.g. vLLM's swap_space); keys that a setting above
    # fills are refused at start-up, naming the setting (mrl/config/engine_fields.py).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # Times one generate call is retried on another (or the restarted) replica after its replica failed.
    max_request_retries: int = 3
    # Seconds a call waits for a replica to serve again when none is registered (all failed and restarting).
    request_retry_wait_s: float = 300.0
    # Seconds between health probes of the replicas (a driver thread); 0 turns probes and restarts off.
    health_check_interval_s: float = 5.0
    # A replica whose health probe is not answered within this many seconds is failed: killed and replaced.
    health_check_timeout_s: float = 60.0
    # Replacements of one replica before it is dropped for the rest of the run.
    max_replica_restarts: int = 3
    # Seconds every replica may take to answer a control call (sleep, wake, abort, resume, cache, health).
    control_timeout_s: float = 600.0
    # Seconds the agent loops may take to return the trajectories of one generation round.
    generate_timeout_s: float = 3600.0
    # Address the inference engines' own endpoints listen on (SGLang's HTTP server, vLLM's VLLM_HOST_IP and NIXL
    # side channel). Their weight-update endpoints take pickled tensors, so anything but loopback needs
    # allow_remote_access.
    server_host: str = "127.0.0.1"
    # Allow a non-loopback server_host (or a remote SGLang server): whoever reaches those ports can replace the
    # weights or run code in the engine. Trusted networks only.
    allow_remote_access: bool = False
    # Prefill/decode-disaggregated replicas instead of plain ones (off by default).
    pd: PDConfig = field(default_factory=PDConfig)


@dataclass
class RolloutCorrectionSettings:
    """Corrections for tokens sampled by another policy than π_old (engine numerics, older weight versions in the
    async modes): weights and masks from ρ = π_old / π_rollout on the policy-gradient term. All off by default;
    each needs rollout.recompute_old_log_prob=true. IcePop = rollout_is=token + rollout_rs=token with the same
    upper bound (weights ρ inside [lower, upper], 0 outside). docs/recipes.md: rollout correction."""

    # Truncated importance sampling: token (w_t = min(ρ_t, C)), sequence (w = min(Π_t ρ_t, C) on every token of
    # the sequence) or null (off).
    rollout_is: str | None = None
    # C of rollout_is (> 0).
    rollout_is_threshold: float = 2.0
    # Rejection (masked IS): token (drop tokens with ρ_t outside [lower, upper]), sequence (drop sequences with
    # Π_t ρ_t outside), geometric (drop sequences whose geometric mean of ρ_t is outside) or null (off).
    rollout_rs: str | None = None
    # Upper bound of rollout_rs (null: rollout_is_threshold).
    rollout_rs_threshold: float | None = None
    # Lower bound of rollout_rs (null: 1 / the upper bound).
    rollout_rs_threshold_lower: float | None = None
    # Drop a whole sequence holding a token with ρ_t below this (null: off).
    rollout_token_veto_threshold: float | None = None
    # Decoupled PPO: the clip around π_old (proximal), the loss weighted by π_old / π_rollout (behaviour); not
    # with rollout_is.
    use_decoupled_loss: bool = False
    # Decoupled PPO: drop tokens whose behaviour weight exceeds this (null: keep all).
    behav_imp_weight_cap: float | None = None


@dataclass
class AlgorithmConfig:
    # Advantage estimator: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gae.
    adv_estimator: str = "grpo"
    # Discount factor (GAE, REINFORCE++).
    gamma: float = 1.0
    # GAE lambda.
    lam: float = 1.0
    # Divide GRPO advantages by the group std (False: Dr.GRPO).
    norm_adv_by_std_in_grpo: bool = True
    # KL penalty in the reward (starts the reference policy): each model token's reward is the score (on the last
    # model token) minus kl_coef × KL(π_old ‖ π_ref) at that token, with kl_coef set by the KL controller.
    use_kl_in_reward: bool = False
    # KL estimator of the reward penalty (with use_kl_in_reward).
    kl_penalty: str = "kl"
    # Initial KL coefficient of the reward penalty.
    kl_coef: float = 0.001
    # KL controller of the reward penalty: fixed or adaptive.
    kl_ctrl_type: str = "fixed"
    # Target KL of the adaptive controller.
    kl_target: float = 0.1
    # Horizon of the adaptive controller.
    kl_horizon: int = 10000
    # Off-policy and training–inference mismatch correction of the actor loss.
    rollout_correction: RolloutCorrectionSettings = field(default_factory=RolloutCorrectionSettings)
    # On-policy distillation from a teacher (reverse-KL per-token advantage, alone or added to the task's).
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class WeightSyncConfig:
    # ipc (same devices) | nccl (a process group to a standalone pool; gloo on CPU) | disk (safetensors by path).
    transport: str = "ipc"
    # Size of the buckets the weight stream is packed into.
    bucket_size_mb: int = 512
    # separate_async: the rollout pool receives weights every parameter_sync_step optimizer updates.
    parameter_sync_step: int = 1
    # colocate_async / separate_async: at most this many weight versions between the oldest token of a sample and
    # the actor that trains on it. The rollout producer starts no group that would exceed it (0: generation waits
    # for every sync) and the replay buffer drops groups that still do (metrics: staleness/*).
    staleness_threshold: int = 1
    # Deadline of every wait of one weight sync (rendezvous, each bucket, each replica's load); when it expires the
    # error names the stage and the ranks that did not answer.
    timeout_s: float = 600.0
    # Address of the sync's control store on the trainer's rank 0 (loopback: replicas on the same node; set the
    # node's address when rollout workers run on other nodes).
    host: str = "127.0.0.1"
    # disk transport: folder for the shards, on a filesystem every rollout node sees (empty: the system temp folder).
    disk_dir: str = ""
    # nccl transport: keep the sync group (communicator, buffers, control store) from one sync to the next while the
    # replicas stay the same, instead of building it every sync (hundreds of ms on two GPUs); a failure rebuilds it.
    keep_group: bool = True
    # ipc: where the rollout engine's TP ranks sit on the devices of the trainer's TP ranks in the same order
    # (engine TP = actor TP), each device receives only its own TP slice of the dense TP-split tensors instead of
    # whole tensors (about 1/TP of those bytes; metrics weight_sync/bytes_sliced and bytes_whole).
    tp_slices: bool = True
    # ipc on CUDA: the trainer shares its exported tensors' own memory (CUDA IPC handles) instead of packing buckets,
    # and the engine copies each tensor straight into its parameter: one device copy instead of two (vLLM: into the
    # parameter views its loaders write, for unquantized models; metrics weight_sync/bytes_one_copy). No effect on CPU.
    one_copy: bool = False

    def sender_kwargs(self) -> dict[str, Any]:
        """Transport-specific arguments of mrl.weight_sync.make_sender."""
        return {"host": self.host, "keep_group": self.keep_group,
                **({"directory": self.disk_dir or None} if self.transport == "disk" else {}),
                **({"one_copy": True} if self.one_copy and self.transport == "ipc" else {})}


@dataclass
class TrainerConfig:
    # sync | colocate_async | separate_async (DESIGN.md glossary).
    mode: str = "sync"
    # Training steps (each: one rollout batch and train_batch_size / ppo_mini_batch_size updates); None: the run
    # length is total_epochs passes over the training prompts (total_epochs × prompts // train_batch_size steps).
    total_training_steps: int | None = 10
    # Passes over the training prompts, used when total_training_steps is None.
    total_epochs: int = 1
    # Wall-clock budget of fit() in seconds (None: none): no step starts after it has passed, and the step that
    # crosses it validates (when test_freq > 0) so the run ends on a measured point, as a scheduler's limit would not;
    # with save_freq > 0 that step is saved, so a later run with resume_mode auto goes on from it.
    time_limit_s: float | None = None
    # Seed of the run (sampling seeds, initialisation).
    seed: int = 1
    # Project name (run folder and loggers).
    project_name: str = "mrl"
    # Experiment name (run folder and loggers).
    experiment_name: str = "run"
    # Run folder: metrics.jsonl, rollouts.jsonl, checkpoints.
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    # Checkpoint every this many steps (-1: never) into default_local_dir/global_step_N (engines, optimizer, LR
    # schedule, dataloader position, RNG states, replay buffer), written atomically.
    save_freq: int = -1
    # Validate every this many steps (-1: never).
    test_freq: int = -1
    # Validate once before the first step.
    val_before_train: bool = True
    # disable | auto | a checkpoint folder: auto resumes from the latest complete global_step_N under
    # default_local_dir (a fresh start when there is none); a folder resumes from that checkpoint.
    resume_mode: str = "auto"
    # Loggers: console (a progress line per step), jsonl (<default_local_dir>/metrics.jsonl, read by mrl report),
    # tensorboard (<default_local_dir>/tensorboard), wandb (<default_local_dir>/wandb; project_name and
    # experiment_name; WANDB_MODE=offline writes locally only).
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # Peak FLOP/s of one device in TFLOP/s, for the MFU metrics; None: by device name (dense bf16 peaks: H100/H200
    # 989, A100 312, ...; mrl/trainer/metrics.py), 1.0 on CPU (nominal: set it for a meaningful CPU MFU).
    peak_tflops_per_device: float | None = None
    # Validation: greedy accuracy on data.val_files, plus pass@k with k temperature samples when val_pass_k > 0.
    val_pass_k: int = 0
    # Trajectories per step written to <default_local_dir>/rollouts.jsonl (0: no dump).
    rollout_dump_per_step: int = 8
    # auto | cuda | cpu: whether workers ask Ray for GPUs; auto uses CUDA where it is available, so a CPU-only
    # machine runs the same code with CPU bundles standing in for devices.
    device: str = "auto"
    # Seconds every worker may take to answer one group call (init, log-probs, updates, weight export); past it
    # the call fails naming the method and the ranks that did not answer.
    dispatch_timeout_s: float = 3600.0
    # Complete checkpoints kept under default_local_dir (None: all); after each save the oldest beyond this many are
    # removed, never the one just written. With save_freq > 0 the final step is always saved as well.
    max_checkpoints_to_keep: int | None = None


@dataclass
class MrlConfig:
    # Run length, mode, logging, checkpoints.
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # The trainer's devices.
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    # Datasets and lengths.
    data: DataConfig = field(default_factory=DataConfig)
    # The HF model to train.
    model: ModelConfig = field(default_factory=ModelConfig)
    # Actor engine and PPO loss.
    actor: ActorConfig = field(default_factory=ActorConfig)
    # Reference policy engine.
    ref: RefConfig = field(default_factory=RefConfig)
    # Critic engine.
    critic: CriticConfig = field(default_factory=CriticConfig)
    # Inference replicas and agent loops.
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Advantage estimator and KL in reward.
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # Reward functions.
    reward: RewardConfig = field(default_factory=RewardConfig)
    # How weights reach the rollout replicas.
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


def register_configs() -> None:
    """Make `mrl_config` available to Hydra's defaults lists (idempotent)."""
    ConfigStore.instance().store(name=ROOT_CONFIG_NAME, node=MrlConfig)
