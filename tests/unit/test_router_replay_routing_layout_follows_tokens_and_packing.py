"""The routing field of router replay: one row per token aligned with input_ids (-1 where the engine never routed
the token), packed into THD rows and cut to sequence-parallel slices as the routers see them; the hf backend's
routing equals the model's own router top-k; metrics count agreement and expert load."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mrl.data.samples import fill_unrouted, routed_experts
from mrl.engine.megatron.packing import JaggedBatch, pack
from mrl.engine.megatron.routing import local_rows, moe_layer_numbers, packed_routing, routing_metrics


def test_moe_layers_follow_megatron_layer_freq():
    assert moe_layer_numbers(4, 1) == [1, 2, 3, 4]
    assert moe_layer_numbers(4, 2) == [1, 3]
    assert moe_layer_numbers(4, [0, 1, 1, 1]) == [2, 3, 4]  # DeepSeek-V3: first_k_dense_replace=1


def test_trajectory_routing_takes_the_longest_turn_and_marks_the_rest_unrouted():
    first = torch.zeros(3, 2, 2, dtype=torch.int16)
    second = torch.ones(6, 2, 2, dtype=torch.int16)  # the next turn's prefill covered the observation tokens
    routing = routed_experts([{"routed_experts": first}, {}, {"routed_experts": second}], length=8)
    assert routing.shape == (8, 2, 2) and bool((routing[:6] == 1).all()) and bool((routing[6:] == -1).all())
    assert routed_experts([{}, {"server": "x"}], length=4) is None
    filled = fill_unrouted([routing, None], [{"input_ids": torch.zeros(8)}, {"input_ids": torch.zeros(5)}])
    assert filled[1].shape == (5, 2, 2) and bool((filled[1] == -1).all())


def test_packed_routing_follows_the_row_and_sequence_parallel_slices():
    lengths = [3, 5, 2]
    routing = [torch.arange(n * 4, dtype=torch.int16).view(n, 2, 2) + 100 * i for i, n in enumerate(lengths)]
    batch = JaggedBatch.from_sequences([{"input_ids": torch.arange(n), "routed_experts": r}
                                        for n, r in zip(lengths, routing)])
    mb = pack(batch, [2, 0, 1], pad_to_multiple=4)  # 10 tokens → a 12-token row
    packed = packed_routing(mb.fields, mb.token_mask, mb.input_ids.shape[1])
    want = torch.cat([routing[2], routing[0], routing[1], torch.full((2, 2, 2), -1, dtype=torch.int16)])
    assert torch.equal(packed, want)
    assert torch.equal(local_rows(packed, True, 1, 2), want[6:])
    assert torch.equal(local_rows(packed, False, 1, 2), want)


def test_metrics_count_agreement_over_routed_tokens_and_expert_load():
    engine = torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]]])
    own = torch.tensor([[[1, 0]], [[2, 0]], [[3, 3]]])
    m = routing_metrics(own, engine, num_experts=4)
    assert m["actor/routing_agreement"] == 0.5  # order inside the top-k is free; the unrouted token is not counted
    assert m["actor/expert_load_max_over_mean/layer_0"] == pytest.approx(2 / 1.5)  # counts 2, 1, 1, 2


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from mrl.models.tiny import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe"), tokenizer=False))


def test_hf_backend_returns_the_routers_top_k_of_every_fed_token(moe_folder):
    from rollout_adapters.hf.adapter import HFAdapter

    adapter = HFAdapter(moe_folder, return_routed_experts=True)
    prompt = [5, 9, 17, 33]
    out = asyncio.run(adapter.generate("r", prompt, {"max_tokens": 6, "seed": 1, "ignore_eos": True}))
    routing = out.extra["routed_experts"]
    assert routing.dtype == torch.int16 and routing.shape == (len(prompt) + 6 - 1, 2, 2)
    # the same tokens in one forward: the routers' own indices (hooked on the HF model's gates)
    captured = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: captured.append(o[2]))
             for layer in adapter.model.model.layers]
    with torch.no_grad():
        adapter.model(input_ids=torch.tensor([prompt + out.token_ids[:-1]]))
    for h in hooks:
        h.remove()
    full = torch.stack(captured, dim=1)
    assert torch.equal(routing.sort(-1).values.long(), full.sort(-1).values.long())


def test_hf_backend_loads_per_expert_tensors_into_fused_experts(moe_folder, tmp_path):
    import glob

    from safetensors.torch import load_file

    from mrl.models.tiny import make_tiny_hf_model
    from rollout_adapters.hf.adapter import HFAdapter

    other = make_tiny_hf_model("qwen3_moe", tmp_path / "other", tokenizer=False, seed=5)
    named = {k: v for f in glob.glob(f"{other}/*.safetensors") for k, v in load_file(f).items()}
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in named)  # the export / safetensors names
    adapter = HFAdapter(moe_folder)
    assert adapter._load_named(list(named.items())) == len(named)
    want = HFAdapter(str(other)).model.state_dict()
    for k, v in adapter.model.state_dict().items():
        assert torch.equal(v, want[k]), k
