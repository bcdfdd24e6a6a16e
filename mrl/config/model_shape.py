"""Parameter counts and KV-cache sizes of a model, read from its HF `config.json` alone (no weights, no torch).

`mrl plan` needs the shape of models that are not on this machine, so besides a local HF folder a model can come
from the built-in table: the published `config.json` values of each recipe family, kept beside the recipes as
`recipes/<family>/models/<HF repo name>.json` and found by the base name of `model.path` (a recipe's placeholder
`/models/Qwen3-8B` finds `recipes/qwen3/models/Qwen3-8B.json`). Adding a family's size is adding one JSON file.

Counts follow the HF module layout of the supported families (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3):
attention (GQA with optional q/k/v biases and q/k norms, or MLA's low-rank q and kv paths), a gated MLP or routed
experts (+ shared experts and a router), two RMSNorms per layer, embeddings and an untied output layer.
DeepSeek-V3's multi-token-prediction layers are left out, as the bridges leave them out. With rollout.quantization=fp8
the export's bytes count the linear weights as block FP8 (`ModelShape.export_bytes`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrl.config import RECIPES_DIR

# Qwen2's attention always has q/k/v biases (the HF model hard-codes them, config.json does not say so).
_QKV_BIAS_ALWAYS = {"qwen2"}
_QK_NORM = {"qwen3", "qwen3_moe"}
_SCORE_CORRECTION_BIAS = {"deepseek_v3"}  # a router buffer per MoE layer (one value per expert) the bridge exports
FP8_BLOCK = 128  # mrl/weight_sync/fp8.py BLOCK (not imported: that module imports torch)


@dataclass(frozen=True)
class ModelShape:
    """What memory and sync estimates need: parameter counts split by how Megatron shards them."""

    name: str
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    embedding_params: int  # input embedding; the untied output layer has as many again
    output_params: int
    # Summed over all layers: everything but routed experts (attention, norms, dense MLPs, routers, shared
    # experts) is sharded over TP; routed experts over EP × expert-TP.
    layer_dense_params: int
    layer_expert_params: int
    active_params: int  # per token: dense parts plus top-k routed experts
    kv_bytes_per_token: int  # all layers, bf16, one full replica (before TP/PP splits)
    kv_heads: int  # KV heads split over rollout TP (0 for MLA, whose latent cache is replicated over TP)
    # The linear weights rollout.quantization=fp8 sends as block FP8 (attention and MLP projections, experts'
    # too): their parameters, and their fp32 scales (one per 128 × 128 block, edge blocks partial).
    quantized_params: int = 0
    fp8_scales: int = 0
    exported_buffers: int = 0  # values the export sends beside the parameters (DeepSeek's score-correction bias)

    @property
    def total_params(self) -> int:
        return self.embedding_params + self.output_params + self.layer_dense_params + self.layer_expert_params

    def export_bytes(self, quantization: str | None = None) -> int:
        """Bytes of one full weight export to the rollout engine: bf16, or with `fp8` each linear weight as one byte
        per parameter plus its scales (mrl/weight_sync/fp8.py) and the rest in bf16."""
        bf16 = self.total_params + self.exported_buffers
        if quantization != "fp8":
            return bf16 * 2
        return self.quantized_params + 4 * self.fp8_scales + (bf16 - self.quantized_params) * 2

    @property
    def is_moe(self) -> bool:
        return self.layer_expert_params > 0


def _attention_linears(c: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(rows, columns, how many) of one layer's attention projections as HF shapes them: GQA's q/k/v/o, or MLA's
    low-rank q and kv paths and o."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("kv_lora_rank"):  # MLA
        qk_head, v_head, kv_lora = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        q_lora = c.get("q_lora_rank")
        q = [(q_lora, h, 1), (heads * qk_head, q_lora, 1)] if q_lora else [(heads * qk_head, h, 1)]
        kv = [(kv_lora + c["qk_rope_head_dim"], h, 1), (heads * (c["qk_nope_head_dim"] + v_head), kv_lora, 1)]
        return [*q, *kv, (h, heads * v_head, 1)]
    head_dim = c.get("head_dim") or h // heads
    q_out, kv_out = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    return [(q_out, h, 1), (kv_out, h, 2), (h, q_out, 1)]


def _attention_params(c: dict[str, Any]) -> int:
    """The projections plus what is not a linear weight: MLA's two low-rank norms; q/k/v biases, q/k norms."""
    linears = _attention_linears(c)
    params = sum(rows * cols * count for rows, cols, count in linears)
    if c.get("kv_lora_rank"):
        return params + (c.get("q_lora_rank") or 0) + c["kv_lora_rank"]
    if c.get("attention_bias") or c.get("model_type") in _QKV_BIAS_ALWAYS:
        params += sum(rows * count for rows, _, count in linears[:2])  # one per q, k and v output row
    if c.get("model_type") in _QK_NORM:
        params += 2 * (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return params


def _linear_weights(c: dict[str, Any], moe_layer: bool) -> list[tuple[int, int, int]]:
    """(rows, columns, how many) of one decoder layer's HF linear weights: its attention and MLP projections (each
    expert's, the shared experts' as one MLP), which rollout.quantization=fp8 quantises; the router is not one."""
    h, attention = c["hidden_size"], _attention_linears(c)
    if not moe_layer:
        return [*attention, (c["intermediate_size"], h, 2), (h, c["intermediate_size"], 1)]
    expert, shared = c["moe_intermediate_size"], (c.get("n_shared_experts") or 0) * c["moe_intermediate_size"]
    mlp = [(expert, h, 2 * num_experts(c)), (h, expert, num_experts(c))]
    return attention + mlp + ([(shared, h, 2), (h, shared, 1)] if shared else [])


def num_experts(c: dict[str, Any]) -> int:
    # Spellings: Qwen3-MoE's published config, DeepSeek, and transformers 5's serialisation of Qwen3-MoE.
    return int(c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0)


def _is_moe_layer(c: dict[str, Any], layer: int) -> bool:
    if num_experts(c) == 0:
        return False
    if "first_k_dense_replace" in c:  # DeepSeek
        return layer >= c["first_k_dense_replace"] and layer % c.get("moe_layer_freq", 1) == 0
    step = c.get("decoder_sparse_step", 1) or 1
    return layer not in (c.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def moe_layer_indices(c: dict[str, Any]) -> list[int]:
    """0-based indices of the decoder layers of an HF config that have routed experts, in layer order."""
    return [layer for layer in range(c["num_hidden_layers"]) if _is_moe_layer(c, layer)]


def _kv_bytes_per_token(c: dict[str, Any], layers: int) -> tuple[int, int]:
    """(bytes per token over all layers in bf16, KV heads that rollout TP splits)."""
    if c.get("kv_lora_rank"):
        # vLLM caches MLA's compressed latent plus the rope key: one vector per token and layer.
        return 2 * layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]), 0
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    kv_heads = c.get("num_key_value_heads") or heads
    return 2 * layers * 2 * kv_heads * head_dim, kv_heads


def shape_from_config(c: dict[str, Any], name: str = "") -> ModelShape:
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    mlp = 3 * h * c.get("intermediate_size", 0)  # gate, up, down
    experts, top_k = num_experts(c), int(c.get("num_experts_per_tok") or 0)
    expert_mlp = 3 * h * c.get("moe_intermediate_size", 0)
    shared = c.get("n_shared_experts") or 0
    router = h * experts  # DeepSeek's score-correction bias is a buffer, not a parameter
    attention, norms = _attention_params(c), 2 * h
    dense = expert = active = quantized = scales = buffers = 0
    for layer in range(layers):
        moe = _is_moe_layer(c, layer)
        for rows, cols, count in _linear_weights(c, moe):
            quantized += rows * cols * count
            scales += -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK) * count
        if moe:
            layer_dense = attention + norms + router + shared * expert_mlp
            dense += layer_dense
            expert += experts * expert_mlp
            active += layer_dense + top_k * expert_mlp
            buffers += experts if c.get("model_type") in _SCORE_CORRECTION_BIAS else 0
        else:
            dense += attention + norms + mlp
            active += attention + norms + mlp
    embedding = vocab * h
    output = 0 if c.get("tie_word_embeddings", False) else vocab * h
    dense += h  # final norm
    kv_bytes, kv_heads = _kv_bytes_per_token(c, layers)
    return ModelShape(
        name=name or c.get("_name_or_path", ""),
        architecture=(c.get("architectures") or [c.get("model_type", "?")])[0],
        hidden_size=h,
        num_layers=layers,
        vocab_size=vocab,
        embedding_params=embedding,
        output_params=output,
        layer_dense_params=dense,
        layer_expert_params=expert,
        active_params=active + h + embedding + output,
        kv_bytes_per_token=kv_bytes,
        kv_heads=kv_heads,
        quantized_params=quantized,
        fp8_scales=scales,
        exported_buffers=buffers,
    )


def builtin_configs() -> dict[str, Path]:
    """Published config.json values by HF repo name (lower-cased), from recipes/<family>/models/*.json."""
    return {p.stem.lower(): p for p in sorted(RECIPES_DIR.glob("*/models/*.json"))}


def resolve_model_config(model_path: str, model_config: str | None = None) -> tuple[dict[str, Any], str]:
    """(config dict, where it came from): `model_config` (a JSON file or a built-in name) if given, else
    `<model_path>/config.json` if it exists, else the built-in entry named like the base name of `model_path`."""
    builtin = builtin_configs()
    candidates: list[Path] = []
    if model_config:
        candidates.append(Path(model_config))
        candidates.append(builtin.get(Path(model_config).stem.lower(), Path("/nonexistent")))
    else:
        candidates.append(Path(model_path) / "config.json")
        candidates.append(builtin.get(Path(model_path.rstrip("/")).name.lower(), Path("/nonexistent")))
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text()), str(path)
    wanted = model_config or model_path
    raise FileNotFoundError(
        f"no config.json for {wanted!r}: not an HF folder here, and no built-in shape of that name "
        f"(built-in: {sorted(p.stem for p in builtin.values())}); pass --model-config PATH_OR_NAME"
    )


def stage_layers(layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers of each pipeline stage under Megatron's split: `first` / `last` where set, the middle stages an even
    share of the rest (a split that `pipeline_split_problem` refuses gives the shares rounded down)."""
    if pp <= 1:
        return [layers]
    ends = (first, last)
    middle_stages = pp - sum(n is not None for n in ends)
    share = (layers - sum(n or 0 for n in ends)) // middle_stages if middle_stages else 0
    out = [share] * pp
    out[0], out[-1] = first if first is not None else out[0], last if last is not None else out[-1]
    return out


def pipeline_split_problem(layers: int, pp: int, vpp: int | None, overrides: Any) -> str | None:
    """Megatron's rule for splitting `layers` over PP stages (× VPP chunks), with its uneven split: the first
    and last stages may hold `num_layers_in_first/last_pipeline_stage` layers (`<role>.megatron`) and the middle
    stages split the rest evenly."""
    if pp < 1:
        return None
    chunks = vpp or 1
    ends = [overrides.get(f"num_layers_in_{end}_pipeline_stage") for end in ("first", "last")]
    if all(n is None for n in ends):
        if layers % (pp * chunks):
            return (f"PP × VPP = {pp * chunks} model chunks must divide the model's {layers} layers (or set "
                    "num_layers_in_first/last_pipeline_stage for an uneven split)")
        return None
    middle_layers = layers - sum(n for n in ends if n is not None)
    middle_stages = pp - sum(n is not None for n in ends)
    given = ", ".join(f"num_layers_in_{end}_pipeline_stage={n}" for end, n in zip(("first", "last"), ends)
                      if n is not None)
    if any(n is not None and (n < 1 or n % chunks) for n in ends) or bool(middle_layers) != bool(middle_stages) \
            or (middle_stages and (middle_layers % middle_stages or middle_layers // middle_stages % chunks)):
        return (f"with {given}, the other {middle_layers} of the model's {layers} layers must split evenly over "
                f"the {middle_stages} middle stage(s) (each stage's layers a multiple of VPP = {chunks})")
    return None


def layout_shape_problems(hf: dict[str, Any], tp: int, pp: int, vpp: int | None, ep: int,
                          overrides: Any = None, vocab_divisor: int = 1) -> Iterator[tuple[str, str]]:
    """(layout knob, rule) for each way a Megatron layout does not fit the model's HF config: TP over heads,
    key-value heads and the vocabulary (padded to a multiple of vocab_divisor × TP, every rank holding real rows),
    PP × VPP over
    layers, EP over routed experts. Shared by the start-up rules and `mrl convert`."""
    heads = int(hf.get("num_attention_heads", 1))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    layers, experts, vocab = int(hf.get("num_hidden_layers", 1)), num_experts(hf), hf.get("vocab_size")
    # Fewer key-value heads than TP ranks: megatron-core 0.19 all-gathers the QKV projection and each rank takes
    # its group, so TP must be a multiple of the KV heads (bridges/mapping.py FusedQKV).
    if tp >= 1 and (heads % tp or (kv_heads % tp and tp % kv_heads)):
        yield "tensor_model_parallel_size", (f"must divide the model's attention heads ({heads}) and key-value "
                                             f"heads ({kv_heads}), or be a multiple of the key-value heads")
    elif tp > 1 and vocab and (tp - 1) * -(-vocab // (step := max(vocab_divisor, 1) * tp)) * step // tp >= vocab:
        # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by × TP (bridges/mapping.py
        # padded_vocab_size) and gives each rank an equal block of rows: the last rank must still hold a real row.
        yield "tensor_model_parallel_size", (f"pads the model's vocabulary ({vocab} tokens) to a multiple of {step} "
                                             "rows (make_vocab_size_divisible_by × TP), so a rank holds only "
                                             "padding: use a smaller TP or divisor")
    split = pipeline_split_problem(layers, pp, vpp, overrides or {})
    if split and not (pp == 1 and (vpp or 1) > 1):  # VPP without PP: its own line
        yield "pipeline_model_parallel_size", split
    if ep > 1 and (experts == 0 or experts % ep):
        yield "expert_model_parallel_size", (f"must divide the model's routed experts ({experts})" if experts else
                                             "the model has no experts (dense): expert parallel needs an MoE model")
