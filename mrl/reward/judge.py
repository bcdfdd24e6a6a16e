"""Generative reward models (LLM-as-judge, `reward.models[i].kind: generative`): a causal LM, served by rollout
replicas of its own (the project's adapters: vLLM, SGLang, TensorRT-LLM or HF; mrl/trainer/build.py starts them),
reads a prompt rendered from a template over the sample's prompt, response and ground truth, and a parser turns its
answer into the score.

Every request of a step goes out at once (the engine batches them). An answer that does not parse — no regex match,
a parser function returning None or raising, a non-finite number, an empty answer when the rendered prompt fills
the judge's context — scores `fallback_score` and is counted: `reward/<name>/parse_failures` and
`reward/<name>/parse_failure_rate` per step, and the first failing answer is printed once, so a wrong template or
parser shows in the first step rather than as a reward that is quietly constant.

The start-up rules (mrl/config/startup/reward_rules.py) call `template_fields` and `make_parser`, so a config that
starts is one these accept.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import re
import string
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mrl.reward.distinct import once_per_distinct

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")
# "package.module:function": read as a parser function, never as a regex (a regex of this shape has no group, which
# a regex parser must have, so the two readings never compete).
_FUNCTION_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

Parser = Callable[[str], "float | None"]


@dataclass(frozen=True)
class JudgeInput:
    """What the template may name: the prompt's text (its last user message), the response's, the ground truth."""

    prompt: str
    response: str
    ground_truth: str = ""


def prompt_text(messages: Sequence[Mapping[str, Any]] | str) -> str:
    """The question a judge reads: the last user message of a chat prompt (system prompts and earlier turns are the
    policy's instructions, not what is being answered); a plain-text prompt as it is."""
    if isinstance(messages, str):
        return messages
    users = [str(m.get("content", "")) for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def template_fields(template: str) -> list[str]:
    """The fields `template` names; raises ValueError on a malformed template or a field other than
    {prompt}, {response}, {ground_truth} (attribute, index and conversion syntax included: a judge's prompt is
    plain text)."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"not a format string ({err}); write literal braces as {{{{ and }}}}") from err
    named = [name for _, name, spec, conv in parts if name is not None]
    unknown = [name or "{}" for name in named if name not in TEMPLATE_FIELDS]
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(TEMPLATE_FIELDS)} (literal braces "
                         "as {{ and }})")
    if any(spec or conv for _, name, spec, conv in parts if name is not None):
        raise ValueError("fields take no format spec or conversion (write {prompt}, not {prompt!r} or {prompt:>9})")
    if "response" not in named:
        raise ValueError("the template must name {response}: a judge that never sees the response scores nothing")
    return named


def render(template: str, item: JudgeInput) -> str:
    return template.format(prompt=item.prompt, response=item.response, ground_truth=item.ground_truth)


def make_parser(spec: str) -> Parser:
    """`spec`: "package.module:function" (answer text → float, or None when it cannot say), or a regex whose first
    group is the number (the first match in the answer). Raises ValueError when the function does not load, the
    regex does not compile or has no group."""
    if _FUNCTION_SPEC.match(spec):
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"parser function {spec!r} does not load: {err}") from err
        if not callable(fn):
            raise ValueError(f"parser {spec!r} is a {type(fn).__name__}, not a function")
        return fn
    try:
        pattern = re.compile(spec)
    except re.error as err:
        raise ValueError(f"not a regex ({err}) nor a 'package.module:function'") from err
    if pattern.groups < 1:
        raise ValueError("a regex parser needs a group around the number, e.g. 'Score: (\\d+)'")

    def first_group(answer: str) -> float | None:
        match = pattern.search(answer)
        return None if match is None or match.group(1) is None else float(match.group(1))

    return first_group


def parse_score(parser: Parser, answer: str) -> tuple[float | None, str | None]:
    """(score, None), or (None, why) when the answer gives no finite number; never raises (a parser's bug costs
    one sample's score, counted, not the run)."""
    try:
        value = parser(answer)
        if value is None:
            return None, "no score in the answer"
        score = float(value)
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"
    return (score, None) if math.isfinite(score) else (None, f"non-finite score {score}")


class ParseCounts:
    """Answers and failed parses since the last `take` (thread-safe: async modes score from their producer)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = self.failures = 0
        self.first_failure: str | None = None
        self._lock = threading.Lock()

    def record(self, answer: str, why: str | None) -> None:
        with self._lock:
            self.calls += 1
            if why is None:
                return
            self.failures += 1
            first, self.first_failure = self.first_failure is None, self.first_failure or why
        if first:  # once per run: the text a user needs to fix the template or parser, without a line per sample
            print(f"[mrl] reward model {self.name!r}: an answer did not parse ({why}): {answer[:200]!r}", flush=True)

    def take(self) -> dict[str, float]:
        with self._lock:
            calls, failures, self.calls, self.failures = self.calls, self.failures, 0, 0
        if not calls:
            return {}
        return {f"reward/{self.name}/parse_failures": float(failures),
                f"reward/{self.name}/parse_failure_rate": failures / calls}


class GenerativeJudge:
    """One judge: its rollout replicas, the judge's tokenizer, template and parser. Built in the driver; `score`
    blocks until every answer of the batch is back."""

    def __init__(self, c: Any, replicas: Any) -> None:
        """`c`: a RewardModelConfig of kind generative; `replicas`: the LLMServerManager serving `c.path`, started
        by the trainer's build (mrl/trainer/build.py `start_judge`; the rollout layer sits above this one)."""
        from transformers import AutoTokenizer

        template_fields(c.template)
        self.name, self.template, self.parser = c.name, c.template, make_parser(c.parser)
        self.fallback, self.chat_template = float(c.fallback_score), c.chat_template
        self.tokenizer = AutoTokenizer.from_pretrained(c.path)
        self.sampling = {"temperature": c.temperature, "top_p": c.top_p, "max_tokens": c.max_new_tokens,
                         "logprobs": False}
        self.manager = replicas
        self.counts = ParseCounts(c.name)

    def prompt_ids(self, item: JudgeInput) -> list[int]:
        text = render(self.template, item)
        if self.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _answer(self, client: Any, request_id: str, ids: list[int]) -> str:
        out = await client.generate(request_id, ids, self.sampling)
        await client.end_session(request_id)
        return self.tokenizer.decode(out.token_ids, skip_special_tokens=True)

    async def answers(self, items: Sequence[JudgeInput]) -> list[str]:
        """The judge's answer text to each item, all requests in flight together (the engines batch them). A greedy
        judge answers each distinct prompt once: identical samples would get the same answer."""
        client, batch = self.manager.client(), uuid.uuid4().hex[:8]

        async def answer_all(prompts: list[tuple[int, ...]]) -> list[str]:
            return list(await asyncio.gather(*(self._answer(client, f"judge-{self.name}-{batch}-{i}", list(ids))
                                               for i, ids in enumerate(prompts))))

        prompts = [tuple(self.prompt_ids(x)) for x in items]
        if self.sampling["temperature"] == 0:
            return await once_per_distinct(prompts, answer_all)
        return await answer_all(prompts)

    def scores(self, answers: Sequence[str]) -> list[float]:
        out = []
        for answer in answers:
            score, why = parse_score(self.parser, answer)
            self.counts.record(answer, why)
            out.append(self.fallback if score is None else score)
        return out

    def wait_started(self) -> None:
        self.manager.wait_started()

    def close(self) -> None:
        self.manager.shutdown()


async def judge_all(judges: Mapping[str, GenerativeJudge], items: Sequence[JudgeInput]) -> dict[str, list[float]]:
    """Every judge's scores of `items`, the judges answering concurrently."""
    names = list(judges)
    answers = await asyncio.gather(*(judges[name].answers(items) for name in names))
    return {name: judges[name].scores(a) for name, a in zip(names, answers)}
