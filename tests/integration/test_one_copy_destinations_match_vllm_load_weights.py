"""The one-copy loader's destinations (rollout_adapters/vllm/direct_load.py) against vLLM's own model classes, built
on CPU before any post-load repacking: copying every HF tensor into its destination view gives, bit for bit, the
parameters the model's `load_weights` gives (Qwen2 with QKV bias, Llama, Qwen3 with q/k norms; TP 1 and TP 2, the
latter also with one KV head replicated over both ranks), with no tensor left to the model's loaders; the same holds
when q/k/v arrive as row blocks of a Megatron linear_qkv (the one-copy export's `row_blocks`) and, at TP 2, when the
dense TP-split tensors arrive as the rank's own slices (weight_sync.tp_slices); and again in later syncs through the
same loader (its cached parameter views), also after every parameter's memory was replaced."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, tie_word_embeddings=False, max_position_embeddings=256, torch_dtype="float32")
FAMILIES = {"Qwen2ForCausalLM": "Qwen2Config", "LlamaForCausalLM": "LlamaConfig", "Qwen3ForCausalLM": "Qwen3Config"}
# The export's TP slices (bridges/export.py): column-split along dim 0, row-split along dim 1; the rest whole.
SLICED = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}
# How the stream brings the tensors: whole HF tensors, the rank's TP slices, q/k/v as row blocks
MODES = {1: ("whole", "blocks"), 2: ("whole", "sliced", "blocks")}


def _write_config(folder: str, arch: str, **overrides: int) -> None:
    import transformers

    config = getattr(transformers, FAMILIES[arch])(**{**TINY, **overrides}, architectures=[arch])
    if arch == "Qwen3ForCausalLM":
        config.head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    config.save_pretrained(folder)


def _hf_tensors(folder: str) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), torch_dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(folder: str, world: int) -> object:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=folder, skip_tokenizer_init=True, load_format="dummy", dtype="float32",
                      max_model_len=256, tensor_parallel_size=world).create_engine_config()


def _build(folder: str, world: int) -> torch.nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    cfg = _config(folder, world)
    with set_current_vllm_config(cfg):
        model = initialize_model(vllm_config=cfg)
    for p in model.parameters():
        p.data.fill_(7.0)  # rows no loader writes keep this
    return model


def _row_blocks(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's q/k/v (weight, bias) as the bridge's row blocks of the Megatron-interleaved linear_qkv."""
    from bridges.mapping import QKV, ModelShape, Shard

    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    mapping, out = QKV("qkv", "q", "k", "v"), {}
    for name in [n for n in hf if ".q_proj." in n]:
        names = [name.replace(".q_proj.", f".{p}_proj.") for p in "qkv"]
        shape = ModelShape(TINY["num_attention_heads"], hf[names[1]].shape[0] // head_dim, head_dim)
        full = mapping.load([hf[n] for n in names], Shard(), shape)
        out.update(zip(names, mapping.to_hf_blocks(full, shape)))
    return out


def _rank_main(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict]:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from bridges.export import ROW_BLOCKS
    from rollout_adapters.vllm.direct_load import DirectLoader

    with set_current_vllm_config(_config(cases[0][1], world)):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
        initialize_model_parallel(world, 1)
    out = []
    for arch, folder in cases:
        hf = _hf_tensors(folder)
        reference = _build(folder, world)
        reference.load_weights(weights=list(hf.items()))
        want = dict(reference.named_parameters())
        blocks = _row_blocks(hf)
        for mode in MODES[world]:
            model = _build(folder, world)
            loader = DirectLoader(model)
            items: list[tuple] = []
            for name, t in hf.items():
                dim = next((d for part, d in SLICED.items() if f".{part}." in name), None)
                kv_whole = (".k_proj." in name or ".v_proj." in name) and t.shape[0] // world < 16  # < 1 head
                if mode == "blocks" and name in blocks:
                    items.append((name, blocks[name], ROW_BLOCKS))
                elif mode == "sliced" and dim is not None and dim < t.dim() and not kv_whole:
                    size = t.shape[dim] // world
                    items.append((name, t.narrow(dim, rank * size, size).contiguous(), [dim, rank, world]))
                else:
                    items.append((name, t))
            loader.load(items)
            got = dict(model.named_parameters())
            mismatched = sorted(n for n in want if not torch.equal(got[n], want[n]))
            stats = dict(loader.stats)
            # later syncs through the same loader: into its cached views, then after every parameter moved
            for moved in (False, True):
                for p in model.parameters():
                    p.data = p.data.clone().fill_(7.0) if moved else p.data.fill_(7.0)
                loader.begin()
                loader.load(items)
                mismatched += [f"{n} (again, moved={moved})" for n in want if not torch.equal(got[n], want[n])]
            out.append({"arch": arch, "folder": folder, "mode": mode, "stats": stats, "world": world,
                        "mapped": len(loader.map), "mismatched": mismatched})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("one_copy")
    out = {}
    for arch in FAMILIES:
        out[arch] = str(root / arch)
        _write_config(out[arch], arch)
    out["kv1"] = str(root / "kv1")
    _write_config(out["kv1"], "Qwen2ForCausalLM", num_key_value_heads=1)
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["mismatched"] == [], r
        # at TP > 1 the vocabulary tensors (embedding, lm_head) go through the model's loaders: vLLM pads and
        # splits the vocabulary its own way
        assert r["stats"]["loader_tensors"] == (0 if r["world"] == 1 else 2) and r["stats"]["direct_tensors"], r


def test_tp1_destinations_give_the_params_of_load_weights(folders):
    results = launch(_rank_main, 1, [(a, folders[a]) for a in FAMILIES], timeout_s=600)
    _check(results[0])
    assert {(r["arch"], r["mode"]) for r in results[0]} == {(a, m) for a in FAMILIES for m in MODES[1]}


def test_tp2_destinations_and_slices_give_each_ranks_params_of_load_weights(folders):
    cases = [("Qwen2ForCausalLM", folders["Qwen2ForCausalLM"]), ("Qwen2ForCausalLM", folders["kv1"])]
    results = launch(_rank_main, 2, cases, timeout_s=600, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    for per_rank in results:
        _check(per_rank)
        assert {(r["folder"], r["mode"]) for r in per_rank} == {(f, m) for _, f in cases for m in MODES[2]}


if __name__ == "__main__":  # quick manual run
    with tempfile.TemporaryDirectory() as d:
        _write_config(d, "Qwen2ForCausalLM")
        print(launch(_rank_main, 1, [("Qwen2ForCausalLM", d)]))
