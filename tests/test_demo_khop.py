"""The demo on the k-hop world (demo.world "khop", configs/demo_cpu_deep.py): the assets' spec and world, and the
evaluation's EM by hop count (the test split's data_source is hop_<k>), on a small hand example."""
from types import SimpleNamespace

import pytest

from llds_jax.apps import demo
from llds_jax.data import khop, synthetic
from llds_jax.train import evaluation
from tests.configs import load


def test_the_demo_builds_the_world_its_config_names():
    two_hop, deep = demo.spec_of(load("demo_cpu")), demo.spec_of(load("demo_cpu_deep"))
    assert "world" not in two_hop  # the spec of the assets built before demo.world existed: reused as they are
    assert deep == {**two_hop, "world": "khop"}
    small = {**deep, "num_people": 40, "seed": 3}
    assert demo._make_world(small) == khop.make_khop_world(num_people=40, seed=3)
    assert demo._make_world({**two_hop, "num_people": 40, "seed": 3}) == synthetic.make_world(num_people=40, seed=3)


def test_em_by_hop_count_of_the_khop_test_split():
    world = khop.make_khop_world(num_people=40, seed=0)
    by_k = {k: [e for e in world.test if e.data_source == f"hop_{k}"] for k in range(1, khop.MAX_HOPS + 1)}
    assert all(len(world.hops[e.question]) == k for k, examples in by_k.items() for e in examples)
    assert len({len(examples) for examples in by_k.values()}) == 1 and len(by_k[1]) >= 2
    # Hand example: both 1-hop questions right, one of two 2-hop ones, a 6-hop one wrong; the others unanswered.
    right = lambda e: e.golden_answers[0]
    answers = [(by_k[1][0], right), (by_k[1][1], right), (by_k[2][0], right), (by_k[2][1], lambda e: "Nobody"),
               (by_k[6][0], lambda e: "Nobody")]
    trajectories = [SimpleNamespace(example=e, answer_text=f"<answer> {answer(e)} </answer>") for e, answer in answers]
    em = evaluation.em_table(trajectories)
    assert em == pytest.approx({"hop_1": 1.0, "hop_2": 0.5, "hop_6": 0.0, "mean": 0.5})
    text = evaluation.format_columns({"start": {"hop_1": 0.0, "hop_2": 0.0, "hop_6": 0.0, "mean": 0.0},
                                      "step 20": em}, {"hop_1": 2, "hop_2": 2, "hop_6": 1})
    assert text.splitlines() == ["data_source   start  step 20  n",
                                 "hop_1         0.000    1.000  2",
                                 "hop_2         0.000    0.500  2",
                                 "hop_6         0.000    0.000  1",
                                 "mean          0.000    0.500"]
