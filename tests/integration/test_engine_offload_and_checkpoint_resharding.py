"""Offload and checkpoints keep training exact.

- Offloading params, grads and optimizer state between two steps frees their storage (0 bytes held) and, after
  coming back, training continues bitwise identically to a run that never offloaded (DP=2, distributed
  optimizer, so parameters live in DDP buffers and Adam moments are sharded).
- A dist-checkpoint saved at TP=2 after one step and loaded at TP=1 (DP=2) continues with the same losses for the
  next two steps as the TP=2 run itself (model, Adam moments and LR schedule restored; 1e-5 fp32), and back:
  saved at TP=1, loaded at TP=2.
- The same with Megatron's distributed optimizer (its state resharded from TP=2×DP=1 to TP=1×DP=2), including a
  checkpoint saved before the first optimizer step (Adam state not created yet): loaded at TP=1, the first step's
  loss is the TP=2 run's; the TP=2 checkpoint also continues identically at PP=2, and loaded again into an engine
  that has trained since, it restores the LR schedule's step count (not advanced twice) and the same next loss.
- In bf16 every parameter is bf16 (the local spec's norms too, as Megatron-LM's Float16Module casts them), and a
  checkpoint of the distributed optimizer saves and loads (a float32 norm in a bf16 group broke the save).
- With actor.lora the checkpoint holds the adapters (B split like a column-parallel weight, A like a row-parallel
  one) and their Adam state: saved at TP=2 after one step and loaded at TP=1 (DP=2), training continues with the
  TP=2 run's losses.
"""

from __future__ import annotations

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

VOCAB = 512


def batch():

    g = torch.Generator().manual_seed(11)
    seqs = []
    for _ in range(6):
        n = int(torch.randint(6, 15, (1,), generator=g))
        mask = torch.zeros(n)
        mask[n // 2 :] = 1
        seqs.append(
            {
                "input_ids": torch.randint(0, VOCAB, (n,), generator=g),
                "response_mask": mask,
                "advantages": torch.randn(n, generator=g),
            }
        )
    return seqs


def loss_fn(outputs, mb, normalizer):
    from mrl.algo.aggregation import agg_loss

    return agg_loss(-mb["advantages"] * outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}


def engine(path: str, tp: int, distributed_optimizer: bool = True, pp: int = 1, lora: bool = False,
           dtype: str = "float32"):
    from mrl.config.schema import LoRAConfig, MegatronConfig, OptimConfig
    from mrl.engine.megatron.engine import MegatronEngine

    cfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         use_distributed_optimizer=distributed_optimizer, params_dtype=dtype)
    e = MegatronEngine(
        path, cfg, OptimConfig(lr=1e-3, lr_warmup_steps=0, lr_decay_style="linear"), micro_batch_size=2, total_steps=6,
        lora=LoRAConfig(enable=True, rank=4, alpha=8.0) if lora else None,
    )
    e.initialize()
    return e


def step(e) -> float:
    from mrl.engine.megatron.packing import JaggedBatch

    mesh = e.mesh()
    data = batch()[mesh.dp_rank :: mesh.dp_size]
    loss = e.forward_backward(JaggedBatch.from_sequences(data), loss_fn)["loss"]
    e.optimizer_step()
    return loss


def weights(e) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in e.export_weights()}


def run(rank: int, world: int, path: str, ckpt_dir: str) -> dict:
    from mrl.engine.megatron import offload
    from mrl.engine.megatron.parallel import teardown

    out: dict = {}
    try:
        # offload round trip vs no offload
        plain = engine(path, 1)
        plain_losses = [step(plain) for _ in range(3)]
        plain_weights = weights(plain)
        moved = engine(path, 1)
        moved_losses = [step(moved)]
        moved.to("cpu")
        held = [t.untyped_storage().nbytes() for t in offload.param_tensors(moved.model)]
        held += [t.untyped_storage().nbytes() for t in offload.grad_tensors(moved.model)]
        held += [t.untyped_storage().nbytes() for t in offload.optimizer_tensors(moved.optimizer)]
        moved.to("cuda")
        moved_losses += [step(moved) for _ in range(2)]
        moved_weights = weights(moved)
        out["offload"] = {
            "bytes_held_while_offloaded": sum(held),
            "optimizer_tensors": len(offload.optimizer_tensors(moved.optimizer)),
            "losses_equal": plain_losses == moved_losses,
            "weights_equal": all(torch.equal(plain_weights[k], moved_weights[k]) for k in plain_weights),
        }
        # TP2 → TP1 → TP2 through checkpoints
        tp2 = engine(path, 2, distributed_optimizer=False)
        first = step(tp2)
        tp2.save_checkpoint(f"{ckpt_dir}/tp2_step1")
        tp2_losses = [first, step(tp2), step(tp2)]
        tp1 = engine(path, 1, distributed_optimizer=False)
        tp1.load_checkpoint(f"{ckpt_dir}/tp2_step1")
        tp1_losses = [step(tp1)]
        tp1.save_checkpoint(f"{ckpt_dir}/tp1_step2")
        tp1_losses.append(step(tp1))
        back = engine(path, 2, distributed_optimizer=False)
        back.load_checkpoint(f"{ckpt_dir}/tp1_step2")
        out["reshard"] = {"tp2": tp2_losses, "tp1": tp1_losses, "back_to_tp2": [step(back)]}
        # the same with the distributed optimizer, and a checkpoint written before any optimizer step
        dist2 = engine(path, 2)
        dist2.save_checkpoint(f"{ckpt_dir}/dist_tp2_step0")
        first = step(dist2)
        dist2.save_checkpoint(f"{ckpt_dir}/dist_tp2_step1")
        dist2_losses = [first, step(dist2), step(dist2)]
        # (each engine trains before the next one is built: Megatron's parallel state is one per process)
        dist1 = engine(path, 1)
        dist1.load_checkpoint(f"{ckpt_dir}/dist_tp2_step1")
        out["dist_reshard"] = {"tp2": dist2_losses, "tp1": [step(dist1), step(dist1)]}
        dist1.load_checkpoint(f"{ckpt_dir}/dist_tp2_step1")  # into an engine that trained: nothing carries over
        out["dist_reshard"]["reloaded"] = [dist1.scheduler.num_steps, step(dist1)]
        fresh = engine(path, 1)
        fresh.load_checkpoint(f"{ckpt_dir}/dist_tp2_step0")
        out["dist_reshard"]["from_step0"] = [step(fresh)]
        pp2 = engine(path, 1, pp=2)
        pp2.load_checkpoint(f"{ckpt_dir}/dist_tp2_step1")
        out["dist_reshard"]["pp2"] = [step(pp2), step(pp2)]
        lora2 = engine(path, 2, lora=True)
        first = step(lora2)
        lora2.save_checkpoint(f"{ckpt_dir}/lora_tp2_step1")
        lora_losses = [first, step(lora2), step(lora2)]
        lora1 = engine(path, 1, lora=True)
        lora1.load_checkpoint(f"{ckpt_dir}/lora_tp2_step1")
        out["lora_reshard"] = {"tp2": lora_losses, "tp1": [step(lora1), step(lora1)]}
        # bf16 with the distributed optimizer: every parameter (norms included) in bf16, saved after a step
        bf16 = engine(path, 1, dtype="bfloat16")
        out["bf16_dtypes"] = sorted({str(p.dtype) for c in bf16.unwrapped() for p in c.parameters()})
        first = step(bf16)
        bf16.save_checkpoint(f"{ckpt_dir}/bf16_step1")
        bf16_losses = [first, step(bf16), step(bf16)]
        bf16_again = engine(path, 1, dtype="bfloat16")
        bf16_again.load_checkpoint(f"{ckpt_dir}/bf16_step1")
        out["bf16"] = {"saved": bf16_losses, "loaded": [step(bf16_again), step(bf16_again)]}
    finally:
        teardown()
    return out


def test_offload_round_trip_and_checkpoint_resharding(tmp_path):
    from mrl.models.tiny import make_tiny_hf_model

    path = str(make_tiny_hf_model("qwen3", tmp_path / "model", tokenizer=False, vocab_size=VOCAB))
    results = launch(run, 2, path, str(tmp_path / "ckpt"), timeout_s=900)
    for r in results:
        off = r["offload"]
        assert off["optimizer_tensors"] > 0
        assert off["bytes_held_while_offloaded"] == 0
        assert off["losses_equal"] and off["weights_equal"]
        tp2, tp1, back = r["reshard"]["tp2"], r["reshard"]["tp1"], r["reshard"]["back_to_tp2"]
        assert len(set(tp2)) == 3
        assert abs(tp1[0] - tp2[1]) < 1e-5 and abs(tp1[1] - tp2[2]) < 1e-5, (tp2, tp1)
        assert abs(back[0] - tp2[2]) < 1e-5, (tp2, back)
        dist = r["dist_reshard"]
        assert len(set(dist["tp2"])) == 3
        assert all(abs(a - b) < 1e-5 for a, b in zip(dist["tp1"], dist["tp2"][1:])), dist
        assert all(abs(a - b) < 1e-5 for a, b in zip(dist["pp2"], dist["tp2"][1:])), dist
        assert dist["reloaded"][0] == 1 and abs(dist["reloaded"][1] - dist["tp2"][1]) < 1e-5, dist
        assert abs(dist["from_step0"][0] - dist["tp2"][0]) < 1e-5, dist
        lora = r["lora_reshard"]
        assert len(set(lora["tp2"])) == 3 and lora["tp2"] != dist["tp2"], lora
        assert all(abs(a - b) < 1e-5 for a, b in zip(lora["tp1"], lora["tp2"][1:])), lora
        # Megatron's distributed-optimizer checkpoint needs one dtype per parameter group (norms were float32)
        assert r["bf16_dtypes"] == ["torch.bfloat16"], r["bf16_dtypes"]
        assert r["bf16"]["loaded"] == r["bf16"]["saved"][1:], r["bf16"]
