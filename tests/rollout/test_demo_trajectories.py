"""The rollout engine reproduces, token for token, the demo's trajectories recorded from the dense engine before the
paged one replaced it (tests/rollout/demo_greedy.py): greedy and sampled, chains, continuous and trees."""
import json

import pytest

from tests.rollout import demo_greedy


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_greedy.Demo(str(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="module")
def recorded():
    with open(demo_greedy.TRAJECTORIES) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(demo_greedy.SETTINGS))
def test_the_demos_trajectories_are_the_recorded_ones(demo, recorded, setting):
    trajectories = demo.rollout(setting)
    assert len(trajectories) == len(recorded[setting])
    for i, (got, want) in enumerate(zip(trajectories, recorded[setting])):
        assert got == want, f"{setting} trajectory {i} differs"


def test_the_record_holds_searches_and_every_setting():
    with open(demo_greedy.TRAJECTORIES) as f:
        record = json.load(f)
    assert set(record) == set(demo_greedy.SETTINGS)
    multi_turn = sum(1 for t in record["chains_sampled"]
                     if sum(1 for a, b in zip(t["loss_mask"], t["loss_mask"][1:]) if b > a) > 1)
    assert multi_turn >= 10  # conversations that searched and went on after the observation
