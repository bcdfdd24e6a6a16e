"""A generative judge's prompt is its template over {prompt}, {response}, {ground_truth} (anything else refused);
its answer becomes a score through a regex's first group or a `module:function`; an answer without a finite number
is a counted failure, never an exception and never a silent 0."""

import pytest

from mrl.reward.judge import JudgeInput, ParseCounts, make_parser, parse_score, prompt_text, render, template_fields

ITEM = JudgeInput(prompt="3817", response="7183", ground_truth="7183")


def last_word_number(answer: str) -> float | None:
    """A parser function: the answer's last word as a number, None when it is not one."""
    words = answer.split()
    try:
        return float(words[-1]) if words else None
    except ValueError:
        return None


def broken(answer: str) -> float:
    raise KeyError("bug in the parser")


def test_template_renders_every_field_and_literal_braces():
    template = "Q {prompt} A {response} T {ground_truth} {{json}}"
    assert template_fields(template) == ["prompt", "response", "ground_truth"]
    assert render(template, ITEM) == "Q 3817 A 7183 T 7183 {json}"
    assert render("{response}{response}", JudgeInput("p", "r")) == "rr"


@pytest.mark.parametrize(("template", "says"), [
    ("Q {question} A {response}", "unknown field(s) question"),
    ("Q {} A {response}", "unknown field(s) {}"),
    ("Q {prompt.upper} A {response}", "unknown field(s) prompt.upper"),
    ("Q {prompt[0]} A {response}", "unknown field(s) prompt[0]"),
    ("Q {prompt!r} A {response}", "no format spec or conversion"),
    ("Q {prompt:>9} A {response}", "no format spec or conversion"),
    ("Q {prompt}", "must name {response}"),
    ("", "must name {response}"),
    ("A {response", "not a format string"),
    ("A {response} }", "not a format string"),
])
def test_template_with_unknown_fields_or_bad_syntax_is_refused(template, says):
    with pytest.raises(ValueError) as err:
        template_fields(template)
    assert says in str(err.value)


def test_prompt_text_is_the_last_user_message():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "3817"}]
    assert prompt_text(messages) == "3817"
    assert prompt_text("plain prompt") == "plain prompt"
    assert prompt_text([{"role": "system", "content": "x"}]) == ""


def test_regex_parser_takes_the_first_group_of_the_first_match():
    parse = make_parser(r"Score:\s*(-?\d+(?:\.\d+)?)")
    assert parse_score(parse, "Reasoning 4 then Score: 7.5, later Score: 2") == (7.5, None)
    assert parse_score(parse, "Score: -3") == (-3.0, None)
    assert parse_score(parse, "no verdict") == (None, "no score in the answer")
    optional = make_parser(r"Score: (\d+)?")  # the group may match nothing: no score, not a crash
    assert parse_score(optional, "Score: ") == (None, "no score in the answer")


def test_regex_without_a_group_or_not_compiling_is_refused():
    with pytest.raises(ValueError, match="needs a group"):
        make_parser(r"Score: \d+")
    with pytest.raises(ValueError, match="not a regex"):
        make_parser(r"Score: (\d+")
    with pytest.raises(ValueError, match="needs a group"):
        make_parser("pkg:")  # not a function spec (no attribute), and a regex without a group


def test_function_parser_loads_and_its_failures_are_reported():
    parse = make_parser(f"{__name__}:last_word_number")
    assert parse_score(parse, "the score is 4") == (4.0, None)
    assert parse_score(parse, "no idea") == (None, "no score in the answer")
    assert parse_score(make_parser(f"{__name__}:broken"), "9") == (None, "KeyError: 'bug in the parser'")
    with pytest.raises(ValueError, match="does not load"):
        make_parser(f"{__name__}:no_such_function")
    with pytest.raises(ValueError, match="does not load"):
        make_parser("no_such_package.module:parse")
    with pytest.raises(ValueError, match="not a function"):
        make_parser(f"{__name__}:ITEM")


def test_non_finite_numbers_are_failures():
    parse = make_parser(r"(\S+)")
    assert parse_score(parse, "nan")[0] is None and "non-finite" in parse_score(parse, "nan")[1]
    assert parse_score(parse, "inf")[0] is None
    assert parse_score(parse, "1e3") == (1000.0, None)


def test_parse_counts_are_per_step_and_print_the_first_failure_once(capsys):
    counts = ParseCounts("judge")
    for answer, why in (("7", None), ("??", "no score in the answer"), ("x", "no score in the answer"), ("1", None)):
        counts.record(answer, why)
    assert counts.take() == {"reward/judge/parse_failures": 2.0, "reward/judge/parse_failure_rate": 0.5}
    assert counts.take() == {}  # nothing scored since: no metric rather than a rate of 0/0
    counts.record("!!", "no score in the answer")
    assert counts.take()["reward/judge/parse_failure_rate"] == 1.0
    printed = capsys.readouterr().out
    assert printed.count("did not parse") == 1 and "'??'" in printed
