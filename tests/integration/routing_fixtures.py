"""A tiny Qwen3-MoE whose routers sit near ties, and rollouts of it with the engine's routing (router replay tests).

Every router row is one shared vector plus 1e-3 of its own noise, so the router logits of a token differ by little
between experts: the bf16 rollout engine and the fp32 trainer then often pick different experts, as a large MoE
does in bf16, while the experts themselves differ (their own random weights), so a different pick changes logits.
"""

from __future__ import annotations

import asyncio
import pathlib

import torch

VOCAB = 512
NEAR_TIE = 1e-3


def make_near_tie_moe(out_dir: pathlib.Path) -> str:
    from mrl.models.tiny import build_tiny_hf_model

    model = build_tiny_hf_model("qwen3_moe", vocab_size=VOCAB, seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            shared = torch.randn(w.shape[1], generator=g) * 0.1
            w.copy_(shared + NEAR_TIE * torch.randn(w.shape, generator=g))
    model.save_pretrained(out_dir)
    return str(out_dir)


def rollouts(path: str, n: int = 6, max_tokens: int = 10, dtype: str = "bfloat16") -> list[dict[str, torch.Tensor]]:
    """`n` sampled trajectories of the hf backend in `dtype`, each with its per-token fields as the agent loop
    stores them (input_ids, response_mask, rollout_log_probs, routed_experts)."""
    from mrl.data.samples import payload, routed_experts
    from rollout_adapters.hf.adapter import HFAdapter

    adapter = HFAdapter(path, dtype=dtype, return_routed_experts=True)
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        sampling = {"temperature": 1.0, "max_tokens": max_tokens, "seed": i, "ignore_eos": True}
        result = asyncio.run(adapter.generate(f"r{i}", prompt, sampling))
        fields = payload(prompt, result.token_ids, [1] * len(result.token_ids), result.log_probs)
        fields["routed_experts"] = routed_experts([result.extra], len(fields["input_ids"]))
        out.append(fields)
    return out


def replay_passes(rank: int, world: int, path: str, data: list[dict[str, torch.Tensor]], layout: dict
                  ) -> dict[str, torch.Tensor]:
    """In a Megatron process: `infer` of every sample without the engine's routing (the trainer routes: `free`),
    with it (R3: `r3`) and with the free pass's own routing (R2: `r2`), each with the routing the forward used and
    the routers' own top-k; then one update step replaying the engine's routing, whose loss is −mean log-prob of
    the response tokens (`update_loss`). Every rank returns them."""
    from mrl.algo.aggregation import agg_loss
    from mrl.config.schema import MegatronConfig, OptimConfig
    from mrl.engine.megatron.engine import MegatronEngine
    from mrl.engine.megatron.packing import JaggedBatch
    from mrl.engine.megatron.parallel import teardown

    cfg = MegatronConfig(**layout, router_replay="rollout",
                         override_transformer_config={"moe_aux_loss_coeff": 0.0,
                                                      "moe_router_load_balancing_type": "none"})
    engine = MegatronEngine(path, cfg, OptimConfig(lr=0.0), micro_batch_size=2)
    engine.initialize()
    out = {}
    for name, keys in (("free", ["input_ids"]), ("r3", ["input_ids", "routed_experts"])):
        batch = JaggedBatch.from_sequences([{k: s[k] for k in keys} for s in data])
        out.update({f"{name}/{k}": v for k, v in engine.infer(batch, routing=True).items()})
    offsets = JaggedBatch.from_sequences([{"input_ids": s["input_ids"]} for s in data]).offsets
    recorded = [out["free/routed_experts"][a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    batch = JaggedBatch.from_sequences([{"input_ids": s["input_ids"], "routed_experts": r}
                                        for s, r in zip(data, recorded)])
    out.update({f"r2/{k}": v for k, v in engine.infer(batch, routing=True).items()})

    def loss_fn(outputs, mb, normalizer):
        return agg_loss(-outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}

    mesh = engine.mesh()
    mine = [{k: s[k] for k in ("input_ids", "routed_experts", "response_mask")} for s in data]
    out["update_loss"] = torch.tensor(engine.forward_backward(
        JaggedBatch.from_sequences(mine[mesh.dp_rank :: mesh.dp_size]), loss_fn)["loss"])
    teardown()
    return out


def mismatch(trainer_logp: torch.Tensor, data: list[dict[str, torch.Tensor]]) -> float:
    """`logprob_mismatch` over the response tokens: mean exp(|Δlogp|) between rollout and trainer."""
    rollout = torch.cat([s["rollout_log_probs"] for s in data])
    mask = torch.cat([s["response_mask"] for s in data]).bool()
    return float(torch.exp((trainer_logp - rollout).abs())[mask].mean())
