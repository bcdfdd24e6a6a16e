"""ActorConfig's verl knobs choose the engine's micro-batching (token budget with use_dynamic_bsz, else count)
and its parallel layout, without touching Megatron (construction is lazy)."""

from mrl.config.schema import ActorConfig, MegatronConfig
from mrl.engine.megatron.engine import MegatronEngine


def test_dynamic_batch_size_uses_the_token_budget():
    actor = ActorConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=1234)
    engine = MegatronEngine.from_actor_config("unused", actor)
    assert engine.max_tokens == 1234 and engine.micro_batch_size is None


def test_count_micro_batches_and_layout():
    actor = ActorConfig(
        ppo_micro_batch_size_per_gpu=3,
        megatron=MegatronConfig(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
        ),
    )
    engine = MegatronEngine.from_actor_config("unused", actor, total_steps=7)
    assert engine.micro_batch_size == 3 and engine.max_tokens is None and engine.total_steps == 7
    assert (engine.layout.tp, engine.layout.pp, engine.layout.vpp, engine.layout.ep) == (2, 2, 2, 2)
