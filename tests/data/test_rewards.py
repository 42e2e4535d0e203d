"""Search-R1's exact-match reward on literal cases."""
import pytest

from llds_jax.data import rewards


@pytest.mark.parametrize("raw,normalized", [
    ("The Beatles", "beatles"),
    ("  PARIS\t\n", "paris"),
    ("an apple a day", "apple day"),
    ("Theory of the Leisure Class", "theory of leisure class"),
    ("A.B.C.", "abc"),
    ("U.S.A.!", "usa"),
    ("the-the", "thethe"),
    ("Anthem, Then, Athens", "anthem then athens"),
    ("rock 'n' roll", "rock n roll"),
    ("A", ""),
    ("", ""),
    ("café  Ünïcode", "café ünïcode"),
    ("“curly” quotes", "“curly” quotes"),
])
def test_normalize_answer(raw, normalized):
    assert rewards.normalize_answer(raw) == normalized


def test_normalize_order_punctuation_before_articles():
    # Punctuation goes first, so "a." becomes the article "a" and is dropped; "a-b" fuses into "ab".
    assert rewards.normalize_answer("Plan a. Then b") == "plan then b"
    assert rewards.normalize_answer("a-b") == "ab"


@pytest.mark.parametrize("prediction,golds,em", [
    ("the Eiffel Tower", ["Eiffel Tower"], 1.0),
    ("Eiffel  tower.", ["eiffel tower"], 1.0),
    ("Tower", ["Eiffel Tower"], 0.0),
    ("Theory", ["the ory"], 0.0),
    ("1984", ["Nineteen Eighty-Four", "1984"], 1.0),
    ("London", ["Paris", "France"], 0.0),
    ("Paris", "paris", 1.0),
    ("", ["the"], 1.0),
    ("x", [], 0.0),
])
def test_exact_match(prediction, golds, em):
    assert rewards.exact_match(prediction, golds) == em


def test_extract_final_answer_takes_last():
    text = "<answer> first </answer> then <search>q</search> <answer>\n Second one \n</answer> tail"
    assert rewards.extract_final_answer(text) == "Second one"
    assert rewards.extract_final_answer("<answer></answer>") == ""
    assert rewards.extract_final_answer("<answer>x <answer>y</answer>") == "x <answer>y"
    assert rewards.extract_final_answer("<answer>unclosed") is None
    assert rewards.extract_final_answer("<ANSWER>Paris</ANSWER>") is None


def test_em_reward():
    golds = ["Paris", "City of Light"]
    assert rewards.em_reward("<think>hmm</think><answer> the city of light </answer>", golds) == 1.0
    assert rewards.em_reward("<answer>Paris</answer><answer>Lyon</answer>", golds) == 0.0
    assert rewards.em_reward("<answer>Lyon</answer> ... <answer>PARIS!</answer>", golds) == 1.0
    assert rewards.em_reward("Paris", golds) == 0.0
    assert rewards.em_reward("", golds) == 0.0
