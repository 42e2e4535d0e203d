"""The evaluation tables: EM and searches per question per data_source, their unweighted mean, the printed
columns (exact values)."""
from types import SimpleNamespace

import pytest

from llds_jax.train import evaluation


def trajectory(source, reward, searches):
    """A trajectory whose final answer scores `reward` (1.0: "Paris" is right, 0.0: "Lyon" is wrong)."""
    answer = "Paris" if reward else "Lyon"
    return SimpleNamespace(example=SimpleNamespace(data_source=source, golden_answers=("paris",)),
                           answer_text=f"<answer>{answer}</answer>", num_valid_searches=searches)


TRAJECTORIES = [trajectory("nq", 1.0, 1), trajectory("nq", 0.0, 0), trajectory("nq", 1.0, 2),
                trajectory("hotpotqa", 0.0, 3)]


def test_em_and_searches_per_source_and_their_unweighted_mean():
    em = evaluation.em_table(TRAJECTORIES)
    assert list(em) == ["hotpotqa", "nq", "mean"]
    assert em == pytest.approx({"hotpotqa": 0.0, "nq": 2 / 3, "mean": 1 / 3})
    searches = evaluation.searches_table(TRAJECTORIES)
    assert searches == pytest.approx({"hotpotqa": 3.0, "nq": 1.0, "mean": 2.0})
    assert evaluation.em_table([]) == {"mean": 0.0}


def test_columns_print_each_table_side_by_side_with_counts():
    text = evaluation.format_columns({"start": {"nq": 0.0, "mean": 0.0},
                                      "step 20": evaluation.searches_table(TRAJECTORIES)}, {"nq": 3, "hotpotqa": 1})
    assert text.splitlines() == ["data_source   start  step 20  n",
                                 "nq            0.000    1.000  3",
                                 "hotpotqa          -    3.000  1",
                                 "mean          0.000    2.000"]
