"""Math answer extraction and normalised exact match, including malformed inputs that must simply not match."""

from fractions import Fraction

import numpy as np
import pytest

from mrl.reward.math_answer import (
    answers_equal,
    extract_answer,
    extract_gsm8k,
    extract_last_number,
    last_boxed,
    matches_any,
    normalize_answer,
    to_rational,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{{2}+3}", "{2}+3"),
        ("\\fbox{3}", "3"),
        ("answer: \\boxed 5$.", "5"),
        ("\\boxed{7", None),
        ("no box", None),
    ],
)
def test_last_boxed(text: str, expected: str | None):
    assert last_boxed(text) == expected


def test_gsm8k_marker_and_last_number():
    assert extract_gsm8k("work\n#### 12\nmore\n#### 1,234") == "1,234"
    assert extract_gsm8k("#### \n") is None
    assert extract_gsm8k("no marker 5") is None
    assert extract_last_number("we get 3 then -2.5 apples") == "-2.5"
    assert extract_last_number("costs 1,000 dollars") == "1,000"
    assert extract_last_number("ratio 3/4.") == "3/4"
    assert extract_last_number("none here") is None


def test_extraction_prefers_boxed_then_marker_then_last_number():
    assert extract_answer("1 2 \\boxed{3} 4 #### 5") == "3"
    assert extract_answer("1 2 #### 5 and 6") == "5 and 6"
    assert extract_answer("1 2 3") == "3"
    assert extract_answer("") is None


def test_normalisation_and_exact_rationals():
    assert normalize_answer(" $\\dfrac{3}{4}$ ") == "3/4"
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalize_answer("\\text{(B)}") == "(b)"
    assert to_rational("-.50") == Fraction(-1, 2)
    assert to_rational("1.5/3") == Fraction(1, 2)
    assert to_rational("1e3") == 1000
    assert to_rational("2/0") is None
    assert to_rational("abc") is None


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [
        ("0.5", "1/2"),
        (".50", "1/2"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac12", "0.5"),
        ("-\\frac{3}{4}", "-0.75"),
        ("$1,000$", "1000"),
        ("x = 5", "5"),
        ("50\\%", "50"),
        ("10^\\circ", "10"),
        ("3.0", "3"),
        ("\\text{B}", "b"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("\\sqrt{2}", "\\sqrt{2}"),
    ],
)
def test_equal_answers(predicted: str, truth: str):
    assert answers_equal(predicted, truth)


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [("0.333", "1/3"), ("2", "3"), (None, "1"), ("", "1"), ("1/0", "1"), ("(1,2)", "(2,1)"), ("12", "1,2"), ("1", "")],
)
def test_unequal_answers(predicted: str | None, truth: str):
    assert not answers_equal(predicted, truth)


def test_ground_truth_forms():
    assert matches_any("72", "Natalia sold 48 + 24 = 72 clips.\n#### 72")  # a whole GSM8K solution
    assert matches_any("1/2", "The answer is \\boxed{\\frac12}.")  # a whole MATH solution
    assert matches_any("0.5", ["7", "1/2"])
    assert matches_any("0.5", np.array([0.5]))
    assert matches_any("72", 72)
    assert matches_any("0.25", np.float32(0.25))
    for bad in (None, {"answer": "72"}, True, b"72", object()):
        assert not matches_any("72", bad)
