"""Format checks on a response's structure, e.g. a reasoning block followed by an answer."""

import re

_THINK_THEN_ANSWER = re.compile(r"\s*<think>(?P<think>.*?)</think>(?P<answer>.*)", re.DOTALL)


def split_think(text: str) -> tuple[str, str] | None:
    """(reasoning, answer) if the text is exactly one `<think>…</think>` block at the start, with non-empty
    reasoning, followed by a non-empty answer that holds no further think tags; otherwise None."""
    if text.count("<think>") != 1 or text.count("</think>") != 1:
        return None
    match = _THINK_THEN_ANSWER.fullmatch(text)
    if match is None:
        return None
    think, answer = match["think"].strip(), match["answer"].strip()
    return (think, answer) if think and answer else None


def has_think_format(text: str) -> bool:
    return split_think(text) is not None
