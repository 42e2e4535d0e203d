"""The generated search world: every question answerable from the corpus by its hops, and the warm-start
demonstrator's transcripts (searches, observations, guesses, scores)."""
import dataclasses
import hashlib
import json

import pytest

from llds_jax.data import synthetic
from llds_jax import protocol
from llds_jax.sft.demonstrations import parse_record


@pytest.fixture(scope="module")
def world():
    return synthetic.make_world(num_people=40, seed=3)


def by_title(world):
    return {p["contents"].split("\n", 1)[0].strip('"'): p for p in world.passages}


def test_world_is_deterministic_and_answers_are_in_the_last_hop_passage(world):
    again = synthetic.make_world(num_people=40, seed=3)
    assert again.train == world.train and again.test == world.test and again.passages == world.passages
    assert synthetic.make_world(num_people=40, seed=4).train != world.train
    titles = by_title(world)
    for ex in world.train + world.test:
        hops = world.hops[ex.question]
        answer = ex.golden_answers[0]
        assert answer in world.choices[ex.question]
        assert answer in titles[hops[-1]]["contents"]
        assert len(hops) == (2 if ex.data_source == "two_hop" else 1)
        if len(hops) == 2:  # the company passage names the founder searched next
            assert f"founded by {hops[1]}." in titles[hops[0]]["contents"]
    assert {ex.data_source for ex in world.train} == {"single_hop", "two_hop"}


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=dataclasses.astuple).encode()).hexdigest()


def test_world_and_demonstrations_are_the_same_as_before_the_k_hop_world():
    """make_world's world for the demo's size, the demonstrator's transcripts and the tokenizer's texts are those
    of the code before llds_jax.data.khop (the digests were computed at 9ed2dbe, before it)."""
    world = synthetic.make_world(num_people=200, seed=0)
    titles = by_title(world)
    records = synthetic.demonstrations(world, world.train, lambda queries: [[titles[q]["contents"]] for q in queries],
                                       search_fraction=0.5, seed=0)
    assert digest([dataclasses.astuple(world)]) == "d48779bcaa2682642026bb8d97db7efd407144749d88ea832b39d4b2919e2c9a"
    assert digest([records, synthetic.tokenizer_texts(world, records)]) == (
        "c43276ef0ff9a85afee48b3845a53dd8155a00158caff992c6b5f032b94e96cd")


def fake_search(world, calls):
    titles = by_title(world)

    def search(queries):
        calls.append(list(queries))
        return [[titles[q]["contents"]] for q in queries]
    return search


def test_demonstrations_search_every_hop_when_told_to(world):
    calls = []
    records = synthetic.demonstrations(world, world.train, fake_search(world, calls), search_fraction=1.0)
    assert len(records) == len(world.train)
    assert len(calls) == 2  # one batched call per hop
    titles = by_title(world)
    for ex, record in zip(world.train, records):
        parse_record("record", record)
        hops = world.hops[ex.question]
        assert record["score"] == 1.0 and record["question"] == ex.question
        turns = record["turns"]
        assert len(turns) == len(hops) + 1
        for hop, turn in zip(hops, turns):
            assert protocol.parse_action(turn["text"]) == protocol.Action("search", hop)
            assert turn["observation"] == protocol.format_observation([titles[hop]["contents"]])
        assert protocol.parse_action(turns[-1]["text"]) == protocol.Action("answer", ex.golden_answers[0])
        assert "observation" not in turns[-1]


def test_demonstrations_guess_otherwise(world):
    calls = []
    records = synthetic.demonstrations(world, world.train, fake_search(world, calls), search_fraction=0.0, seed=1)
    assert calls == [] or all(q == [] for q in calls)
    for ex, record in zip(world.train, records):
        (turn,) = record["turns"]
        action = protocol.parse_action(turn["text"])
        assert action.kind == "answer" and action.content in world.choices[ex.question]
        assert record["score"] == float(action.content == ex.golden_answers[0])


def test_demonstrations_mix_is_seeded(world):
    search = fake_search(world, [])
    first = synthetic.demonstrations(world, world.train, search, search_fraction=0.4, seed=7)
    assert first == synthetic.demonstrations(world, world.train, search, search_fraction=0.4, seed=7)
    searched = sum(len(r["turns"]) > 1 for r in first)
    assert 0.25 * len(first) < searched < 0.55 * len(first)
    with pytest.raises(ValueError, match="search_fraction"):
        synthetic.demonstrations(world, world.train, search, search_fraction=1.5)


def test_tokenizer_texts_cover_prompts_passages_and_demonstrations(world):
    records = synthetic.demonstrations(world, world.train, fake_search(world, []), search_fraction=0.5)
    texts = synthetic.tokenizer_texts(world, records)
    assert records[0]["turns"][-1]["text"] in texts
    assert world.test[0].question + "\n" in texts  # what follows the instruction phrase in a prompt
    phrases = synthetic.tokenizer_phrases()
    instruction = phrases[0]
    assert not any(p.name in phrases for p in world.people)  # names are frequent parts, not phrases
    assert protocol.make_prompt(world.test[0].question) == instruction + world.test[0].question + "\n"
    assert protocol.format_observation([world.passages[0]["contents"]]) in texts


def test_names_are_pairs_of_parts_that_the_training_split_uses():
    world = synthetic.make_world(num_people=400, seed=0)
    names = [p.name for p in world.people]
    assert len(set(names)) == 400 and len(set(world.founders)) == 100
    firsts, lasts = ({name.split()[i] for name in names} for i in (0, 1))
    assert len(firsts) <= 25 and len(lasts) <= 25 and not firsts & lasts  # ceil(sqrt(1.5 * 400)) words each
    assert {c.split()[1] for c in world.founders} <= set(synthetic.COMPANY_SUFFIXES)
    train_parts = {part for ex in world.train for part in ex.question.split()}
    test_names = {name for name in names if any(name in ex.question for ex in world.test)}
    assert test_names and not any(name in ex.question for name in test_names for ex in world.train
                                  if ex.data_source == "single_hop")
    for name in test_names:  # a test person's name is new, its words are not
        assert set(name.split()) <= train_parts, name
