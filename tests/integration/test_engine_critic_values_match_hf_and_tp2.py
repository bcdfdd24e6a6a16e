"""The trainer's critic (`MegatronCritic.from_critic_config`, the engine `CriticWorker` builds) is HF's
`…ForTokenClassification` with one label: its values equal an HF token-classification forward of the same weights
(value of token t from position t−1) within 1e-5 fp32, at TP=1 and at TP=2 with sequence parallelism.

- From a causal-LM folder the score head is new: weight ~ N(0, initializer_range), bias 0, as HF initialises it, the
  same on every rank; the vocabulary projection is gone (the trainable parameters are exactly the HF
  token-classification model's).
- From a `Qwen3ForTokenClassification` folder (tied embeddings, a trained-looking score head with a bias) the head
  is read from `score.*`.
- A sequence classifier's folder (`Qwen3ForSequenceClassification`, one label: a reward model) built as the frozen
  `MegatronRewardModel` at TP=2 with sequence parallelism (forward-only: no trainable parameter) scores each sample
  as HF's classifier does: its output at the last token, unshifted, within 1e-5.
- One update's loss is the critic's own `critic.loss_agg_mode` (seq-mean-token-mean here) of ½(V − R)², and a TP=2
  critic trains exactly like the TP=1 one (losses, grad norms); its checkpoint, loaded at TP=1, gives its values.
"""

from __future__ import annotations

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

VOCAB = 512
LAYOUTS = {"tp1": {}, "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True}}


def samples():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(4):
        n = int(torch.randint(5, 13, (1,), generator=g))
        mask = torch.zeros(n)
        mask[2:] = 1
        out.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "response_mask": mask,
                    "returns": torch.randn(n, generator=g)})
    return out


def critic_config(layout: dict):
    from mrl.config.schema import CriticConfig, MegatronConfig, OptimConfig

    return CriticConfig(megatron=MegatronConfig(**layout), optim=OptimConfig(lr=1e-3), ppo_micro_batch_size_per_gpu=2,
                        loss_agg_mode="seq-mean-token-mean", cliprange_value=0.5)


def build(path: str, layout: dict):
    from mrl.engine.megatron.critic import MegatronCritic

    critic = MegatronCritic.from_critic_config(path, critic_config(layout))
    critic.initialize()
    return critic


def run(rank: int, world: int, causal: str, scored: str, ckpt: str, classifier: str) -> dict:
    from mrl.engine.megatron.packing import JaggedBatch
    from mrl.engine.megatron.parallel import teardown
    from mrl.workers.critic import make_value_loss_fn

    out: dict = {}
    data = samples()
    batch = JaggedBatch.from_sequences(data)
    try:
        for name, layout in LAYOUTS.items():
            critic = build(causal, layout)
            (last,) = [c for c in critic.unwrapped() if c.post_process]
            head = {k: v.detach().clone() for k, v in last.output_layer.state_dict().items()}
            values = critic.infer(batch)["values"]
            old = torch.split(values, [len(d["input_ids"]) for d in data])
            mesh = critic.mesh()
            rows = [{**d, "values": v} for d, v in zip(data, old)]
            mine = JaggedBatch.from_sequences(rows[mesh.dp_rank :: mesh.dp_size])
            steps = []
            for _ in range(2):
                m = critic.forward_backward(mine, make_value_loss_fn(critic_config(layout)))
                m.update(critic.optimizer_step())
                steps.append(m)
            out[name] = {"head": head, "head_shape": tuple(last.output_layer.weight.shape), "values": values,
                         "steps": steps,
                         "trainable": critic.state_sizes()["trainable_params"],
                         "trained_values": critic.infer(batch)["values"]}
            if name == "tp2_sp":
                critic.save_checkpoint(ckpt)
        resumed = build(causal, LAYOUTS["tp1"])
        resumed.load_checkpoint(ckpt)
        out["resumed_values"] = resumed.infer(batch)["values"]
        out["scored_tp2"] = build(scored, LAYOUTS["tp2_sp"]).infer(batch)["values"]
        from mrl.config.schema import MegatronConfig
        from mrl.engine.megatron.critic import MegatronRewardModel

        rm = MegatronRewardModel(classifier, MegatronConfig(**LAYOUTS["tp2_sp"]), None, micro_batch_size=2)
        rm.initialize()
        out["rm_scores"] = rm.infer(batch)["scores"][batch.offsets[1:] - 1]
        out["rm_trainable"] = rm.state_sizes()["trainable_params"]
    finally:
        teardown()
    return out


def hf_values(model) -> torch.Tensor:
    """HF token-classification values, shifted to the token layout: value of token t from position t−1."""
    expected = []
    for s in samples():
        with torch.no_grad():
            scores = model(s["input_ids"][None]).logits[0, :, 0]
        expected.append(torch.cat([torch.zeros(1), scores[:-1]]))
    return torch.cat(expected)


def make_scored_folder(path, auto_class=None) -> str:
    from transformers import AutoModelForTokenClassification

    from mrl.models.tiny import tiny_hf_config

    config = tiny_hf_config("qwen3", VOCAB, tie_word_embeddings=True, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = (auto_class or AutoModelForTokenClassification).from_config(config, dtype=torch.float32)
        for p in model.parameters():
            p.data.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return str(path)


def test_critic_values_match_hf_token_classification_at_tp1_and_tp2(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from mrl.models.tiny import make_tiny_hf_model

    causal = str(make_tiny_hf_model("qwen3", tmp_path / "model", tokenizer=False, vocab_size=VOCAB))
    scored = make_scored_folder(tmp_path / "scored")
    classifier = make_scored_folder(tmp_path / "classifier", AutoModelForSequenceClassification)
    results = launch(run, 2, causal, scored, str(tmp_path / "ckpt"), classifier, timeout_s=600)

    hf = AutoModelForTokenClassification.from_pretrained(causal, num_labels=1).eval()
    head = results[0]["tp1"]["head"]
    assert head["bias"].item() == 0.0 and 0.01 < head["weight"].std().item() < 0.03  # initializer_range 0.02
    with torch.no_grad():
        hf.score.weight.copy_(head["weight"])
        hf.score.bias.copy_(head["bias"])
    expected = hf_values(hf)
    for rank in range(2):
        for name in LAYOUTS:
            r = results[rank][name]
            assert r["head_shape"] == (1, 128)  # no vocabulary projection: the output layer is the score head
            torch.testing.assert_close(r["head"], head, atol=0, rtol=0)  # the same head on every rank and layout
            torch.testing.assert_close(r["values"], expected, atol=1e-5, rtol=1e-5)
    assert results[0]["tp1"]["trainable"] == sum(p.numel() for p in hf.parameters())

    # The first update's loss: ½(V − R)² (V = V_old, no clipping) in seq-mean-token-mean over the whole batch.
    per_seq, start = [], 0
    for s in samples():
        n, mask = len(s["input_ids"]), s["response_mask"].bool()
        v = expected[start:start + n]
        per_seq.append((0.5 * (v - s["returns"]) ** 2)[mask].mean())
        start += n
    assert results[0]["tp1"]["steps"][0]["loss"] == pytest.approx(float(torch.stack(per_seq).mean()), rel=1e-5)
    for rank in range(2):
        a, b = results[rank]["tp1"], results[rank]["tp2_sp"]
        for sa, sb in zip(a["steps"], b["steps"]):
            assert abs(sa["loss"] - sb["loss"]) < 1e-5, (sa, sb)
            assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 1e-5 * max(1.0, sa["grad_norm"]), (sa, sb)
        assert a["steps"][1]["loss"] < a["steps"][0]["loss"]
        torch.testing.assert_close(results[rank]["resumed_values"], b["trained_values"], atol=1e-5, rtol=1e-5)

    scored_hf = AutoModelForTokenClassification.from_pretrained(scored).eval()
    assert scored_hf.score.bias.abs().item() > 0
    torch.testing.assert_close(results[0]["scored_tp2"], hf_values(scored_hf), atol=1e-5, rtol=1e-5)

    rm = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    with torch.no_grad():
        want = torch.tensor([rm(input_ids=s["input_ids"][None]).logits[0, 0].item() for s in samples()])
    for rank in range(2):
        torch.testing.assert_close(results[rank]["rm_scores"], want, atol=1e-5, rtol=1e-5)
        assert results[rank]["rm_trainable"] == 0  # frozen: no gradient buffer, no optimizer state
