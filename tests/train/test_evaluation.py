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


def test_eval_subset_is_fixed_and_stratified_over_data_sources():
    """Search-R1's test file starts with NQ only: the first rows would evaluate NQ alone. The subset gives each source
    an equal share (a small source all it has, its unused share to the others), drawn by the seed, in file order."""
    examples = ([SimpleNamespace(data_source="nq", row=i) for i in range(20)]
                + [SimpleNamespace(data_source="bamboogle", row=20 + i) for i in range(2)]
                + [SimpleNamespace(data_source="hotpotqa", row=22 + i) for i in range(20)])
    subset = evaluation.stratified_subset(examples, 11, seed=0)
    counts = {source: sum(e.data_source == source for e in subset) for source in ("nq", "bamboogle", "hotpotqa")}
    assert counts == {"bamboogle": 2, "hotpotqa": 4, "nq": 5}  # 11 = 2 + 9 shared: hotpotqa 9 // 2, nq the rest
    assert [e.row for e in subset] == sorted(e.row for e in subset)
    assert evaluation.stratified_subset(examples, 11, seed=0) == subset
    assert evaluation.stratified_subset(examples, 11, seed=1) != subset
    assert evaluation.stratified_subset(examples, 0, seed=0) == examples  # 0: the whole split
    assert evaluation.stratified_subset(examples, 42, seed=0) == examples
    em = evaluation.em_table([trajectory(e.data_source, float(e.data_source == "nq"), 0) for e in subset])
    assert em["mean"] == pytest.approx(1 / 3)  # the mean over the three sources, not NQ's EM
