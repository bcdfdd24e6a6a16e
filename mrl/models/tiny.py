"""Tiny random-weight HF models and a locally trained tokenizer, for tests and the CPU demo.

Nothing here touches the HF hub: the tokenizer is a byte-level BPE trained on the spot from a built-in corpus
(plus caller text), and each model is built from a config with small shapes and seeded random weights, then
saved as an ordinary HF folder (config.json, safetensors, generation_config.json, tokenizer files) that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load offline.

Weights are re-drawn after construction from one `torch.Generator` in parameter-name order, so a (family, seed,
overrides) triple always yields the same tensors and the caller's global RNG is left untouched. Every tensor is
non-trivial on purpose: matrices ~ N(0, init_std²) with init_std large enough that logits are spread (parity
tests compare something), norm weights 1 + N(0, 0.1²) and biases / router correction biases N(0, init_std²),
so a bridge that swaps or drops a norm, a bias or a router buffer is caught by a logits comparison.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DeepseekV3Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")

IM_START, IM_END, END_OF_TEXT, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>"
# Order fixes the ids 0..3: the same special-token ids in every tiny tokenizer.
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, PAD)

# With `tools` (OpenAI function schemas), a system turn names the functions first (kept short: tiny models
# learn the call format from data, and every prompt token costs the CPU demo).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools:' }}{% for tool in tools %}{{ ' ' + tool.function.name }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough varied text that BPE reaches a 512-entry vocabulary: chat roles, arithmetic, digits, prose.
_BUILTIN_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from human feedback trains a policy with rewards from a reward model.",
    "What is two plus two? Two plus two is four. What is three times five? Three times five is fifteen.",
    "system user assistant tool hello world answer question math reasoning step by step",
    "Let us think step by step. First, add the numbers. Then, check the result. The answer is 42.",
    "A policy samples responses; the critic estimates values; the advantage is the return minus the value.",
    "Group relative policy optimization normalizes rewards within a group of responses to one prompt.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "Please answer with a single number inside \\boxed{}. For example: \\boxed{7}.",
    "Once upon a time there was a little model that learned to count: one, two, three, four, five.",
    "Tokens, log-probabilities, entropy, gradients, optimizers and learning rates.",
)


def _corpus(extra: Iterable[str] | None) -> list[str]:
    numbers = " ".join(str(i) for i in range(1000))
    equations = " ".join(f"{a}+{b}={a + b}" for a in range(20) for b in range(20))
    return [*_BUILTIN_CORPUS] * 20 + [numbers, equations, *(extra or ())]


def train_tiny_tokenizer(
    out_dir: str | pathlib.Path | None = None,
    vocab_size: int = 512,
    corpus: Iterable[str] | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (ChatML template, eos = `<|im_end|>`, pad = `<|pad|>`, no bos).

    Deterministic: the same `vocab_size` and `corpus` give the same vocabulary and merges. `len(tokenizer)`
    is at most `vocab_size` (special tokens included). Saved with `save_pretrained` when `out_dir` is given.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(corpus), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, END_OF_TEXT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


# Shared shapes: head_dim 32 with GQA 4 query / 2 KV heads, so TP=2 splits KV heads evenly.
_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# Published Qwen2.5 shapes (GQA, q/k/v biases, tied embeddings below 3B), for GPU tests and benchmarks with random
# weights: `make_tiny_hf_model("qwen2", out, **QWEN2_5_SHAPES["1.5b"])`.
QWEN2_5_SHAPES: dict[str, dict] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    # A width where a decode step's GEMMs outweigh its attention (FP8 rollout's speed, docs/fp8.md).
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768),
}

# A Qwen3-MoE shape for the GPU benchmarks (tools/bench/e2e_gpu.py): 64 experts, top-8, 24 layers, 2.6B parameters of
# which about 0.5B are active per token.
QWEN3_MOE_SHAPES: dict[str, dict] = {
    "moe2.6b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, vocab_size=151936,
                    tie_word_embeddings=True, max_position_embeddings=32768),
    # Qwen3-30B-A3B's layer widths (hidden 2048, 32×128 query heads, 4 KV heads, experts of 768) with 8 of its 48
    # layers and 64 of its 128 experts: 2.9B parameters, 0.76B active per token (the output layer included).
    "moe2.9b": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936,
                    tie_word_embeddings=True, max_position_embeddings=32768),
}

_FAMILY_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama": (LlamaConfig, dict(head_dim=32, attention_bias=False, mlp_bias=False)),
    # Qwen2 attention always has q/k/v biases (hard-coded in the model).
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, dict(head_dim=32, attention_bias=False)),
    "qwen3_moe": (
        Qwen3MoeConfig,
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    # MLA (separate q/kv low-rank paths), one dense layer then MoE layers with a shared expert and grouped
    # top-k routing (8 experts in 2 groups, 1 group kept, top-2 inside it). No multi-token-prediction layers.
    "deepseek_v3": (
        DeepseekV3Config,
        dict(
            num_key_value_heads=4,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            moe_intermediate_size=64,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            num_nextn_predict_layers=0,
        ),
    ),
}


def tiny_hf_config(
    family: str,
    vocab_size: int = 512,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **overrides,
) -> PretrainedConfig:
    """Small fp32 config of `family` (one of FAMILIES); `overrides` replace any field.

    With a `tokenizer`, eos/pad ids come from it; otherwise from the fixed special-token order of
    `train_tiny_tokenizer` (which every tiny tokenizer shares).
    """
    if family not in _FAMILY_CONFIGS:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {FAMILIES}")
    config_cls, family_fields = _FAMILY_CONFIGS[family]
    if tokenizer is not None:
        token_ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    else:
        token_ids = dict(eos_token_id=SPECIAL_TOKENS.index(IM_END), pad_token_id=SPECIAL_TOKENS.index(PAD))
    fields = {
        **_COMMON,
        **family_fields,
        **token_ids,
        "bos_token_id": None,
        "vocab_size": vocab_size,
        "dtype": "float32",
        **overrides,
    }
    return config_cls(**fields)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, init_std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    # Persistent buffers (e.g. DeepSeek-V3's router e_score_correction_bias) are saved, so randomize them too;
    # non-persistent ones (rotary inv_freq) are derived from the config and must stay as computed.
    saved = {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in params}
    for name, tensor in sorted({**params, **saved}.items()):
        if not tensor.is_floating_point():
            continue
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        if tensor.dim() == 1 and "norm" in name:
            tensor.copy_(1.0 + 0.1 * noise)
        else:
            tensor.copy_(init_std * noise)


def build_tiny_hf_model(
    family: str,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    init_std: float = 0.1,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **config_overrides,
) -> PreTrainedModel:
    """The in-memory fp32 model that `make_tiny_hf_model` saves (same family, seed, overrides → same tensors)."""
    config = tiny_hf_config(family, vocab_size, tokenizer=tokenizer, **config_overrides)
    # Construction draws from the global RNG; fork it so building a model has no effect on the caller.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, init_std)
    return model.eval()


def make_tiny_hf_model(
    family: str,
    out_dir: str | pathlib.Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    tokenizer: bool | PreTrainedTokenizerFast = True,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.1,
    max_shard_size: int | str | None = None,
    **config_overrides,
) -> pathlib.Path:
    """Build a tiny `family` causal LM with seeded random weights and save it as an HF folder; return the path.

    `tokenizer=True` trains and saves a tiny tokenizer of `vocab_size`; a tokenizer object is saved as given
    (e.g. one trained on the demo's task text); `False` saves no tokenizer files. `max_shard_size` (e.g.
    "200KB") splits the weights into several safetensors files with a `model.safetensors.index.json`.
    Weights are drawn in fp32 and then cast to `dtype`, so a bf16 model is the rounding of the fp32 one.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is True:
        tok = train_tiny_tokenizer(vocab_size=vocab_size)
    else:
        tok = tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else None
    if tok is not None:
        if len(tok) > vocab_size:
            raise ValueError(f"tokenizer has {len(tok)} tokens but the model vocab_size is {vocab_size}")
        tok.save_pretrained(str(out))
    model = build_tiny_hf_model(
        family, seed=seed, vocab_size=vocab_size, init_std=init_std, tokenizer=tok, **config_overrides
    ).to(dtype)
    model.config.dtype = dtype
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(out), **save_kwargs)
    return out


def make_tiny_reward_model(
    family: str,
    out_dir: str | pathlib.Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int = 0,
    init_std: float = 0.1,
    vocab_size: int | None = None,
    **config_overrides,
) -> pathlib.Path:
    """A tiny `family` `...ForSequenceClassification` (one label: a reward model) with seeded random weights, saved
    with `tokenizer` as an HF folder; return the path. Its vocabulary is the tokenizer's unless `vocab_size` pads
    it (to a policy's: a random policy samples any id of its own vocabulary)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config(family, vocab_size or len(tokenizer), tokenizer=tokenizer, num_labels=1,
                            **config_overrides)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, seed, init_std)
    tokenizer.save_pretrained(str(out))
    model.save_pretrained(str(out))
    return out
