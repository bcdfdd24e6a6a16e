"""Derived step metrics: model FLOPs by the 6·N + 12·L·H·Q·T convention (N counted on a real HF model, without the
input embedding), MFU per stage and per step, peak FLOP/s by device name or knob, peak memory per worker phase
(RSS high-water mark on CPU, reset per phase), staleness from the trajectories' versions."""

import pytest
import torch

from mrl.models.tiny import build_tiny_hf_model, tiny_hf_config
from mrl.trainer.metrics import (
    ModelFlops,
    memory_metrics,
    mfu_metrics,
    peak_flops,
    perf_metrics,
    staleness_metrics,
)
from mrl.utils.phase_memory import PhaseMemory, phase_memory, tracks_memory


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_params_are_the_hf_models_minus_the_input_embedding(family):
    config = tiny_hf_config(family, vocab_size=256)
    model = build_tiny_hf_model(family, vocab_size=256)
    flops = ModelFlops.from_hf_config(config.to_dict())
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    if family == "qwen3_moe":  # a token passes through top-k of the routed experts only
        c = config
        idle_experts = c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok)
        inactive = idle_experts * 3 * c.hidden_size * c.moe_intermediate_size
        assert flops.params == total - embedding - inactive
    else:
        assert flops.params == total - embedding
    assert flops.layers == config.num_hidden_layers
    assert flops.attention_width == config.num_attention_heads * (config.head_dim or config.hidden_size
                                                                  // config.num_attention_heads)


def test_forward_flops_follow_the_convention_by_hand():
    f = ModelFlops(params=1000, layers=2, attention_width=8.0)
    # T=10: 10·(2·1000 + 4·2·8·10) = 10·2640; T=5: 5·(2000 + 4·2·8·5) = 5·2320
    assert f.forward([10, 5]) == 26_400 + 11_600


def test_mfu_per_stage_and_per_step_by_hand():
    f = ModelFlops(params=1000, layers=1, attention_width=10.0)
    forward = 10 * (2000 + 4 * 10 * 10)  # 24,000 for one sequence of 10 tokens
    seconds = {"gen": 3.0, "old_log_prob": 1.0, "update_actor": 2.0, "step": 10.0}
    out = mfu_metrics(f, [10], seconds, peak=1e4, trainer_devices=2, run_devices=4, actor_epochs=2)
    assert out["perf/mfu/old_log_prob"] == pytest.approx(forward / (1.0 * 2 * 1e4))
    assert out["perf/mfu/update_actor"] == pytest.approx(forward * 3 * 2 / (2.0 * 2 * 1e4))  # fwd+bwd, 2 epochs
    assert "perf/mfu/ref" not in out  # not timed: no reference this step
    step_flops = forward * (1 + 6 + 1)  # old log-prob + update + generation (one forward)
    assert out["perf/mfu"] == pytest.approx(step_flops / (10.0 * 4 * 1e4))
    # the old log-prob pass computed half the rows (the first update trained the rest on-policy)
    half = mfu_metrics(f, [10], seconds, peak=1e4, trainer_devices=2, run_devices=4, actor_epochs=2,
                       stage_share={"old_log_prob": 0.5})
    assert half["perf/mfu/old_log_prob"] == pytest.approx(out["perf/mfu/old_log_prob"] / 2)
    assert half["perf/mfu/update_actor"] == out["perf/mfu/update_actor"]


def test_peak_flops_by_knob_or_device_name():
    assert peak_flops("NVIDIA H200", None) == 989e12
    assert peak_flops("NVIDIA H20", None) == 148e12  # not taken for an H200 or the other way round
    assert peak_flops("NVIDIA A100-SXM4-80GB", None) == 312e12
    assert peak_flops("CPU", None) == 1e12
    assert peak_flops("NVIDIA H200", 500.0) == 500e12
    assert peak_flops("Tesla T4", None) is None


def test_perf_metrics_report_throughput_memory_and_skip_mfu_without_a_peak():
    memory = [{"kind": "rss_peak", "device": "Tesla T4", "phases": {"update_actor": 2**30}},
              {"kind": "rss_peak", "device": "Tesla T4", "phases": {"update_actor": 3 * 2**30, "ref": 2**29}}]
    out = perf_metrics([30, 10], {"step": 4.0}, memory, ModelFlops(10, 1, 1.0), None, trainer_devices=2,
                       run_devices=2)
    assert out["perf/tokens_per_s"] == 10.0 and out["perf/tokens_per_s_per_gpu"] == 5.0
    assert out["memory/rss_peak_gib/update_actor"] == 3.0 and out["memory/rss_peak_gib/ref"] == 0.5
    assert not any(k.startswith("perf/mfu") for k in out)  # unknown device, no knob: no made-up MFU
    assert memory_metrics([]) == {}


def test_staleness_counts_versions_behind_the_trainer():
    trajectories = [{"min_version": 3}, {"min_version": 1}, {"min_version": -1}]  # -1: no token generated
    assert staleness_metrics(trajectories, 3) == {"staleness/mean": 1.0, "staleness/max": 2.0}
    assert staleness_metrics([{"min_version": 4}] * 2, 4) == {"staleness/mean": 0.0, "staleness/max": 0.0}


class _Worker:
    @tracks_memory("big")
    def allocate(self, mib: int) -> int:
        block = torch.ones(mib * 2**20 // 4)  # touched pages count in the RSS
        return int(block[-1])

    @tracks_memory("small")
    def idle(self) -> None:
        return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU accounting")
def test_phase_peak_rss_sees_a_freed_allocation_and_resets_between_phases():
    w = _Worker()
    assert w.allocate(256) == 1  # the block is freed on return
    w.idle()
    stats = phase_memory(w).take()
    assert stats["kind"] == "rss_peak" and stats["device"] == "CPU"
    assert stats["phases"]["big"] - stats["phases"]["small"] > 200 * 2**20
    assert phase_memory(w).take()["phases"] == {}  # take() starts the next step afresh


def test_a_phase_entered_twice_keeps_its_larger_peak():
    memory = PhaseMemory()
    with memory("p"):
        pass
    first = memory.phases["p"]
    memory.phases["p"] = first * 10
    with memory("p"):
        pass
    assert memory.phases["p"] == first * 10
