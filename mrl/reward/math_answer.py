"""Math answer extraction and exact match with normalisation.

Extraction: the last `\\boxed{…}` (or `\\fbox{…}`, braces matched), the last GSM8K-style `#### answer` line, or the
last number in the text. Matching: both sides are normalised as strings (dollar signs, thousands separators,
`\\text{}`, `\\left/\\right`, spacing, degree and percent signs, `\\dfrac`, `\\frac{a}{b}` → `a/b`, `x = 5` → `5`);
if both then read as rational numbers they are compared exactly as fractions, so "0.5" == "1/2" == ".50" ==
"\\frac{1}{2}", otherwise the normalised strings must be equal. Nothing here raises on odd input: an answer that
cannot be extracted or parsed is simply not equal.
"""

import numbers
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_GSM8K_ANSWER = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+(?:\.\d+)?)?")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC_BRACED = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_PAREN_NUMBER = re.compile(r"\((-?\d*\.?\d+)\)")
# Exponents stay below 1000: Fraction("1e99999999") would build a 100-million-digit integer from a model's output.
_DECIMAL = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d{1,3})?"
_RATIONAL = re.compile(rf"{_DECIMAL}(?:/{_DECIMAL})?")
_DELETE = ("\\$", "$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\%", "%", "^\\circ", "^{\\circ}", "°", "~")
# Answers longer than this are not math answers; bounding them keeps the regexes cheap on pathological outputs.
_MAX_ANSWER_CHARS = 1000


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{…} / \\fbox{…} (braces matched) or of `\\boxed 5`; None if absent/unclosed."""
    starts = [(text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS]
    start, cmd = max(starts)
    if start < 0:
        return None
    i = start + len(cmd)
    if text.startswith(" ", i):
        rest = text[i:].strip()
        return rest.split()[0].rstrip("$.") if rest else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_gsm8k(text: str) -> str | None:
    """The text after the last `####` (GSM8K's answer marker), or None."""
    matches = _GSM8K_ANSWER.findall(text)
    return (matches[-1].strip() or None) if matches else None


def extract_last_number(text: str) -> str | None:
    """The last number in the text (integers, decimals, thousands separators, simple fractions a/b), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str) -> str | None:
    """\\boxed first, then `####`, then the last number."""
    for extract in (last_boxed, extract_gsm8k, extract_last_number):
        answer = extract(text)
        if answer is not None:
            return answer
    return None


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer (see the module docstring); whitespace-free and lower-case."""
    s = answer.strip()[:_MAX_ANSWER_CHARS]
    s = _TEXT_WRAPPER.sub(r"\1", s)
    for token in _DELETE:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_BRACED.sub(r"(\1)/(\2)", s)
    s = _THOUSANDS_COMMA.sub("", s)
    s = "".join(s.split()).lower()
    # "x=5" / "k=5": a short left-hand side names the unknown, the value is the answer.
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = _PAREN_NUMBER.sub(r"\1", s)
    return s.rstrip(".")


def to_rational(normalized: str) -> Fraction | None:
    """Exact value of an integer, decimal or a/b string (already normalised), or None."""
    if not _RATIONAL.fullmatch(normalized):
        return None
    num, _, den = normalized.partition("/")
    try:
        value = Fraction(num)
        return value / Fraction(den) if den else value
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(predicted: str | None, ground_truth: str) -> bool:
    """Exact match after normalisation; rational numbers compare by value."""
    if predicted is None:
        return False
    pred, truth = normalize_answer(predicted), normalize_answer(ground_truth)
    if not truth:
        return False
    if pred == truth:
        return True
    pred_value, truth_value = to_rational(pred), to_rational(truth)
    return pred_value is not None and pred_value == truth_value


def ground_truth_answers(ground_truth: object) -> list[str]:
    """The accepted answers: a string (a full GSM8K/MATH solution is reduced to its marked answer), a number, or a
    list/array of these; anything else (None, bytes, dicts, booleans) accepts nothing."""
    if isinstance(ground_truth, str):
        marked = extract_gsm8k(ground_truth) if "####" in ground_truth else last_boxed(ground_truth)
        return [marked or ground_truth]
    if isinstance(ground_truth, bool | bytes | Mapping):
        return []
    if isinstance(ground_truth, numbers.Real):  # also numpy scalars, which parquet rows carry
        return [str(ground_truth)]
    if isinstance(ground_truth, Iterable):
        return [answer for item in ground_truth for answer in ground_truth_answers(item)]
    return []


def matches_any(predicted: str | None, ground_truth: object) -> bool:
    return any(answers_equal(predicted, truth) for truth in ground_truth_answers(ground_truth))
