"""The k-hop world (llds_jax.data.khop): facts written only in their subject's passage, questions whose chains need
their k searches in order (no passage of the chain names a later hop or the answer early), a held-out test split
balanced by k, determinism, the demonstrator's transcripts over it, BM25 finding each hop, whole-word names."""
import asyncio
import collections
import re

import pytest

from index_builder.corpus import CorpusReader
from index_builder.to_bm25 import build_bm25
from llds_jax import protocol
from llds_jax.data import khop, synthetic
from llds_jax.data.qa import QAExample
from llds_jax.model.tokenizer import load_tokenizer, train_tokenizer
from llds_jax.search.bm25 import Bm25Retriever
from llds_jax.sft.demonstrations import parse_record

# Each passage kind's text, written out here (not read from khop), with the facts as named groups.
PASSAGE_RE = {
    "person": re.compile(r'"(?P<s>[^"]+)"\n(?P=s) is an? (?P<occupation>\w+) born in (?P<birthplace>\w+)\. (?P=s) was '
                         r"mentored by (?P<mentor>\w+ \w+)\. (?P=s) works for (?P<employer>\w+ \w+)\."),
    "company": re.compile(r'"(?P<s>[^"]+)"\n(?P=s) is a company founded by (?P<founder>\w+ \w+)\. (?P=s) is '
                          r"headquartered in (?P<headquarters>\w+)\."),
    "city": re.compile(r'"(?P<s>[^"]+)"\n(?P=s) is a city whose mayor is (?P<mayor>\w+ \w+)\.'),
}
# A relation's words in a question: the phrase around an inner one, or the question it asks last.
RELATION_WORDS = ("the mentor of", "the company that employs", "the birthplace of", "the occupation of",
                  "the founder of", "the city where", "the mayor of", "Who mentored", "Which company employs",
                  "Where was", "Who founded", "Where is")


@pytest.fixture(scope="module")
def world():
    return khop.make_khop_world(num_people=40, seed=3)


def by_title(world):
    return {p["contents"].split("\n", 1)[0].strip('"'): p["contents"] for p in world.passages}


def named(name, text):
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


def test_exact_values(world):
    assert collections.Counter(world.kinds.values()) == {"person": 40, "company": 10, "city": 4}
    assert (len(world.passages), len(world.train), len(world.test)) == (54, 192, 42)
    assert world.passages[0] == {"id": "0", "contents": '"Rube Poripu"\nRube Poripu is an astronomer born in Tasafu. '
                                 "Rube Poripu was mentored by Lifomo Relazi. Rube Poripu works for Rufi Steel."}
    assert world.passages[40]["contents"] == ('"Rufi Textiles"\nRufi Textiles is a company founded by Tuluku '
                                              "Kadozo. Rufi Textiles is headquartered in Rotomu.")
    assert world.passages[53]["contents"] == '"Rotomu"\nRotomu is a city whose mayor is Bura Relazi.'
    first = {ex.data_source: ex for ex in reversed(world.test)}
    assert first["hop_1"] == QAExample("test-0", "What is the occupation of Biba Relazi?", ("astronomer",),
                                            "hop_1", "test_0")
    ex = first["hop_6"]
    assert (ex.uid, ex.question, ex.golden_answers) == (
        "test-35", "Which company employs the mayor of the birthplace of the mayor of the birthplace of the mentor "
        "of Biba Relazi?", ("Sudubo Bank",))
    assert world.hops[ex.question] == ("Biba Relazi", "Rube Poripu", "Tasafu", "Lifomo Fidafo", "Gezu",
                                       "Tuluku Relazi")
    assert world.chains[ex.question] == ("mentor", "birthplace", "mayor", "birthplace", "mayor", "employer")
    assert world.chains[first["hop_5"].question] == ("employer", "founder", "mentor", "mentor", "mentor")
    assert first["hop_5"].question == ("Who mentored the mentor of the mentor of the founder of the company that "
                                       "employs Biba Relazi?")
    assert first["hop_2"].question == "Where was the mentor of Biba Relazi born?"


def test_every_fact_is_written_once_in_its_subjects_passage_only(world):
    written = {}
    for record in world.passages:
        kind = world.kinds[record["contents"].split("\n", 1)[0].strip('"')]
        match = PASSAGE_RE[kind].fullmatch(record["contents"])  # the whole passage: only its subject's facts
        assert match, record
        facts = {(match["s"], relation): obj for relation, obj in match.groupdict().items() if relation != "s"}
        assert not facts.keys() & written.keys()
        written.update(facts)
    assert written == world.facts
    assert [p["id"] for p in world.passages] == [str(i) for i in range(len(world.passages))]
    relations = {"person": {"mentor", "employer", "birthplace", "occupation"}, "company": {"founder", "headquarters"},
                 "city": {"mayor"}}
    for (subject, relation), obj in world.facts.items():  # every relation a function into its object's kind
        assert relation in relations[world.kinds[subject]]
        kind = "occupation" if obj in khop.OCCUPATIONS else world.kinds[obj]
        assert kind == khop.RELATIONS[relation][1], (subject, relation, obj)
    assert all(world.facts[person, "mentor"] != person for person, kind in world.kinds.items() if kind == "person")


def test_each_question_needs_its_k_searches_in_order(world):
    """Following the facts from the named person along the chain gives the hops and the answer; among the chain's
    passages a hop's entity is named only in its own and the previous hop's, the answer only in the last hop's,
    and the question names only the first: the j-th search needs the (j-1)-th's passage, and the answer is not in
    the first k-1."""
    titles = by_title(world)
    for ex in world.train + world.test:
        k = int(ex.data_source.removeprefix("hop_"))
        chain, hops, answer = world.chains[ex.question], world.hops[ex.question], ex.golden_answers[0]
        assert len(chain) == len(hops) == k
        assert sum(len(re.findall(rf"\b{words}\b", ex.question)) for words in RELATION_WORDS) == k
        entity, names = hops[0], [hops[0]]
        for relation in chain:
            entity = world.facts[entity, relation]
            names.append(entity)
        assert tuple(names) == (*hops, answer) and len(set(names)) == k + 1
        assert answer in world.choices[ex.question]
        assert world.kinds.get(answer, "occupation") == khop.RELATIONS[chain[-1]][1]
        for n, name in enumerate(names):
            assert named(name, ex.question) == (n == 0), (ex.question, name)
            for i, hop in enumerate(hops):
                assert named(name, titles[hop]) == (i in (n - 1, n)), (ex.question, name, hop)


def test_split_is_held_out_by_person_and_balanced_by_k(world):
    counts = collections.Counter(ex.data_source for ex in world.test)
    assert counts == {f"hop_{k}": 7 for k in range(1, 7)}
    assert collections.Counter(ex.data_source for ex in world.train) == {f"hop_{k}": 32 for k in range(1, 7)}
    starts = {split: {world.hops[ex.question][0] for ex in getattr(world, split)} for split in ("train", "test")}
    assert len(starts["test"]) == 8 and not starts["train"] & starts["test"]
    assert not any(named(person, ex.question) for person in starts["test"] for ex in world.train)
    questions = [ex.question for ex in world.train + world.test]
    assert len(set(questions)) == len(questions)
    assert set(world.hops) == set(world.chains) == set(world.choices) == set(questions)  # cut ones dropped
    assert [ex.uid for ex in world.test] == [f"test-{i}" for i in range(42)]
    for num_people, seed in ((20, 0), (100, 1), (300, 2)):
        other = khop.make_khop_world(num_people, seed)
        per_k = collections.Counter(ex.data_source for ex in other.test)
        assert len(per_k) == 6 and len(set(per_k.values())) == 1, (num_people, per_k)
        assert len(other.test) <= 6 * int(num_people * 0.2)
    with pytest.raises(ValueError, match="num_people must be at least 20"):
        khop.make_khop_world(19)


def test_world_is_deterministic_in_its_seed(world):
    assert khop.make_khop_world(num_people=40, seed=3) == world
    other = khop.make_khop_world(num_people=40, seed=4)
    assert other.passages != world.passages and other.train != world.train and other.test != world.test


def fake_search(world, calls):
    titles = by_title(world)

    def search(queries):
        calls.append(list(queries))
        return [[titles[q]] for q in queries]
    return search


def test_demonstrations_search_every_hop_when_told_to(world):
    calls = []
    records = synthetic.demonstrations(world, world.train, fake_search(world, calls), search_fraction=1.0)
    assert len(calls) == 6  # one batched call per hop
    titles = by_title(world)
    for ex, record in zip(world.train, records, strict=True):
        parse_record("record", record)
        hops = world.hops[ex.question]
        assert record["score"] == 1.0 and record["question"] == ex.question
        assert len(record["turns"]) == len(hops) + 1
        for hop, turn in zip(hops, record["turns"]):
            assert protocol.parse_action(turn["text"]) == protocol.Action("search", hop)
            assert turn["observation"] == protocol.format_observation([titles[hop]])
        assert protocol.parse_action(record["turns"][-1]["text"]) == protocol.Action("answer", ex.golden_answers[0])


def test_demonstrations_guess_answers_of_the_kind_otherwise(world):
    records = synthetic.demonstrations(world, world.train, fake_search(world, []), search_fraction=0.0, seed=1)
    kinds = collections.Counter()
    for ex, record in zip(world.train, records, strict=True):
        (turn,) = record["turns"]
        action = protocol.parse_action(turn["text"])
        assert action.kind == "answer" and action.content in world.choices[ex.question]
        assert world.kinds.get(action.content, "occupation") == world.kinds.get(ex.golden_answers[0], "occupation")
        assert record["score"] == float(action.content == ex.golden_answers[0])
        kinds[world.kinds.get(action.content, "occupation")] += 1
    assert set(kinds) == {"person", "company", "city", "occupation"}
    mixed = synthetic.demonstrations(world, world.train, fake_search(world, []), search_fraction=0.4, seed=7)
    assert 0.25 * len(mixed) < sum(len(r["turns"]) > 1 for r in mixed) < 0.55 * len(mixed)


def test_bm25_finds_each_hops_passage_first(world, tmp_path):
    """The demonstrator's observations come from the retriever: the world's BM25 index ranks the passage of every
    hop's entity first for a search of its name."""
    files = synthetic.write_world(world, str(tmp_path / "world"))
    build_bm25(CorpusReader(files["corpus.jsonl"]), str(tmp_path / "index"))
    retriever = Bm25Retriever(str(tmp_path / "index"), workers=1)
    try:
        names = sorted({hop for hops in world.hops.values() for hop in hops})
        results = retriever.search_blocking(names, 3)
    finally:
        asyncio.run(retriever.close())
    assert len(names) == 54
    for name, result in zip(names, results, strict=True):
        assert result.docs[0].contents == by_title(world)[name], name


def test_a_tokenizer_trained_on_the_world_keeps_names_whole(world, tmp_path):
    records = synthetic.demonstrations(world, world.train, fake_search(world, []), search_fraction=0.5)
    texts = synthetic.tokenizer_texts(world, records)
    assert {protocol.format_observation([p["contents"]]) for p in world.passages} <= set(texts)
    assert {ex.question + "\n" for ex in world.train + world.test} <= set(texts)
    tok = load_tokenizer(train_tokenizer(texts, str(tmp_path / "tok"), vocab_size=600,
                                         phrases=synthetic.tokenizer_phrases()))
    for name in world.kinds:  # each part of a name one whole-word token
        assert tok.tokenize(" " + name) == ["Ġ" + part for part in name.split()], name
