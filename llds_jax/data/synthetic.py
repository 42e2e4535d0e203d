"""A generated search world: fictional people with attributes, written as wiki-18 passages, and questions whose
answers are only in the corpus (deterministic from a seed; no downloads).

Each person has a birthplace, an occupation and an employer (a fictional company). Passages follow wiki-18's shape
(`"Title"\\nbody`): one per person, one per company. Questions are single-hop ("Where was X born?", "What is the
occupation of X?") and two-hop ("Where was the founder of Y born?", "What is the occupation of the founder of Y?":
the company passage names its founder, whose passage has the answer).

`demonstrations` writes protocol-format transcripts of an imperfect demonstrator for a supervised warm start: on a
`search_fraction` of the questions it searches (once per hop, with the retriever's real results as observations)
and answers from the documents; on the others it answers at once with a guess of the right kind (a city or an
occupation). A policy imitating it searches now and then and is right mostly when it does: RL has to discover that
searching pays.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from llds_jax.data.qa import QAExample, write_qa_parquet
from llds_jax import protocol

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
CITIES = ("Veltra", "Moskar", "Dunhelm", "Ashbury", "Corvane", "Pelmora", "Tristane", "Halvik", "Orsino", "Quenby")
OCCUPATIONS = ("painter", "chemist", "sailor", "architect", "violinist", "astronomer", "baker", "surgeon")
COMPANY_SUFFIXES = ("Works", "Foods", "Mills", "Labs", "Bank", "Press", "Motors", "Steel", "Textiles", "Shipping")


@dataclasses.dataclass(frozen=True)
class Person:
    name: str
    city: str
    occupation: str
    company: str


@dataclasses.dataclass(frozen=True)
class World:
    """People, companies (name -> founder name), passages (wiki-18 records), QA splits, and per question the
    searches that answer it (the entity of each hop) and the answers of its kind (the demonstrator's guesses)."""

    people: tuple[Person, ...]
    founders: dict[str, str]
    passages: tuple[dict, ...]
    train: tuple[QAExample, ...]
    test: tuple[QAExample, ...]
    hops: dict[str, tuple[str, ...]]
    choices: dict[str, tuple[str, ...]]


class SearchWorld(Protocol):
    """What the demonstrator, `tokenizer_texts` and `write_world` read of a world: this module's `World` or
    llds_jax.data.khop's `KHopWorld`."""

    @property
    def passages(self) -> tuple[dict, ...]: ...
    @property
    def train(self) -> tuple[QAExample, ...]: ...
    @property
    def test(self) -> tuple[QAExample, ...]: ...
    @property
    def hops(self) -> dict[str, tuple[str, ...]]: ...
    @property
    def choices(self) -> dict[str, tuple[str, ...]]: ...


def generated_name(rng: random.Random, used: set[str]) -> str:
    """A capitalised word of 2-3 consonant-vowel syllables not in `used` (and added to it)."""
    while True:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        if word not in used:
            used.add(word)
            return word.capitalize()


def combined_names(rng: random.Random, used: set[str], count: int, heads: int, tails: Sequence[str]) -> list[str]:
    """`count` distinct "Head Tail" names: `heads` generated words, each paired with words of `tails`."""
    head_words = [generated_name(rng, used) for _ in range(heads)]
    return [f"{head} {tail}" for head, tail in rng.sample([(h, t) for h in head_words for t in tails], count)]


def make_world(num_people: int = 200, seed: int = 0, test_fraction: float = 0.2) -> World:
    """A world of `num_people` people and num_people // 4 companies; questions split by person into train/test.

    Names are built from small pools of parts: a person is "First Last" with both words from about
    sqrt(1.5 * num_people) generated words each, a company "Prefix Suffix" with a suffix from `COMPANY_SUFFIXES`.
    Every part is shared by many names, so a test person's name is a new pair of words seen in training, and a
    tokenizer trained on the world keeps each part as one whole-word token.
    """
    rng = random.Random(seed)
    used: set[str] = set()
    num_companies = max(1, num_people // 4)
    companies = combined_names(rng, used, num_companies, -(-num_companies // len(COMPANY_SUFFIXES)) + 1,
                               COMPANY_SUFFIXES)
    pool = max(2, math.ceil(math.sqrt(1.5 * num_people)))
    last_names = [generated_name(rng, used) for _ in range(pool)]
    names = combined_names(rng, used, num_people, pool, last_names)
    people = tuple(Person(name=name, city=rng.choice(CITIES), occupation=rng.choice(OCCUPATIONS),
                          company=rng.choice(companies)) for name in names)
    founders = {company: people[i % num_people].name for i, company in enumerate(companies)}
    passages = [{"contents": f'"{p.name}"\n{p.name} is a {p.occupation} born in {p.city}. '
                             f'{p.name} works for {p.company}.'} for p in people]
    passages += [{"contents": f'"{c}"\n{c} is a company founded by {founder}.'} for c, founder in founders.items()]
    passages = tuple({"id": str(i), **record} for i, record in enumerate(passages))
    questions, hops, choices = [], {}, {}

    def ask(person: int, question: str, answer: str, source: str, searches: tuple[str, ...], kind: tuple[str, ...]):
        questions.append((person, question, answer, source))
        hops[question], choices[question] = searches, kind

    for i, p in enumerate(people):
        ask(i, f"Where was {p.name} born?", p.city, "single_hop", (p.name,), CITIES)
        ask(i, f"What is the occupation of {p.name}?", p.occupation, "single_hop", (p.name,), OCCUPATIONS)
    by_founder = {founder: c for c, founder in founders.items()}
    for i, p in enumerate(people):
        if p.name in by_founder:
            company = by_founder[p.name]
            ask(i, f"Where was the founder of {company} born?", p.city, "two_hop", (company, p.name), CITIES)
            ask(i, f"What is the occupation of the founder of {company}?", p.occupation, "two_hop",
                (company, p.name), OCCUPATIONS)
    test_people = set(rng.sample(range(num_people), max(1, int(num_people * test_fraction))))
    split = {"train": [], "test": []}
    for person, question, answer, source in questions:
        name = "test" if person in test_people else "train"
        split[name].append(QAExample(uid=f"{name}-{len(split[name])}", question=question, golden_answers=(answer,),
                                     data_source=source, id=f"{name}_{len(split[name])}"))
    return World(people=people, founders=founders, passages=passages, train=tuple(split["train"]),
                 test=tuple(split["test"]), hops=hops, choices=choices)


def tokenizer_texts(world: SearchWorld, demonstrations: Sequence[dict] = ()) -> list[str]:
    """Text a tokenizer for the world is trained on: passages as search results show them, the questions as they
    follow the instruction in a prompt (test questions included: only their wording, never their answers), the
    chat roles, and the model turns of `demonstrations` (so the protocol's words are whole tokens). The constant
    protocol text is `tokenizer_phrases`, whole tokens of their own."""
    texts = [protocol.format_observation([p["contents"]]) for p in world.passages]
    texts += [ex.question + "\n" for ex in world.train + world.test]
    texts += [turn["text"] for record in demonstrations for turn in record["turns"]]
    return texts + ["system\nuser\nassistant\n"] * 8


def tokenizer_phrases() -> list[str]:
    """Strings a world tokenizer keeps as single tokens: the constant protocol text (the instruction before every
    question, the invalid-action message, the base chat template's system line). Names are not phrases: their
    parts are frequent words, which the BPE learns as whole-word tokens (" Mopaka"), so a test person's name is
    two tokens the policy has written in training; a name of its own token would be a row of the output layer
    that training never raises, which the policy could not copy into a query."""
    instruction = protocol.SEARCH_R1_TEMPLATE.split("{question}")[0]
    return [instruction, protocol.INVALID_ACTION_MESSAGE, "You are a helpful assistant."]


SEARCH_THOUGHT = "<think> I need to search for {query}. </think>\n<search> {query} </search>"
NEXT_SEARCH_THOUGHT = "<think> Now I need to search for {query}. </think>\n<search> {query} </search>"
ANSWER_THOUGHT = "<think> The documents give the answer. </think>\n<answer> {answer} </answer>"
GUESS_THOUGHT = "<think> I can answer from memory. </think>\n<answer> {answer} </answer>"


def demonstrations(world: SearchWorld, examples: Sequence[QAExample],
                   search: Callable[[list[str]], list[list[str]]], search_fraction: float,
                   seed: int = 0) -> list[dict]:
    """Demonstrator transcripts for `examples` (records of `llds_jax.sft.demonstrations`' format).

    `search(queries)` returns the documents of each query (their `contents`) as the rollout's retriever would
    (same top-k); the observations are `protocol.format_observation` of them. Which questions are
    searched and the guesses are drawn from `seed`. A record's "score" is the EM of its answer.
    """
    if not 0.0 <= search_fraction <= 1.0:
        raise ValueError(f"search_fraction must be in [0, 1], got {search_fraction}")
    rng = random.Random(seed)
    plans = [(ex, rng.random() < search_fraction, rng.choice(world.choices[ex.question])) for ex in examples]
    searched = [ex for ex, searches, _ in plans if searches]
    hop_docs: dict[str, list[str]] = {}
    for hop in range(max((len(world.hops[ex.question]) for ex in searched), default=0)):
        queries = sorted({world.hops[ex.question][hop] for ex in searched if hop < len(world.hops[ex.question])})
        hop_docs.update(zip(queries, search(queries)))
    records = []
    for ex, searches, guess in plans:
        answer = ex.golden_answers[0] if searches else guess
        turns = []
        if searches:
            for hop, query in enumerate(world.hops[ex.question]):
                thought = SEARCH_THOUGHT if hop == 0 else NEXT_SEARCH_THOUGHT
                turns.append({"text": thought.format(query=query),
                              "observation": protocol.format_observation(hop_docs[query])})
        turns.append({"text": (ANSWER_THOUGHT if searches else GUESS_THOUGHT).format(answer=answer)})
        records.append({"question": ex.question, "golden_answers": list(ex.golden_answers), "turns": turns,
                        "score": float(answer in ex.golden_answers)})
    return records


def write_world(world: SearchWorld, out_dir: str) -> dict[str, str]:
    """Writes corpus.jsonl, train.parquet and test.parquet (Search-R1 schema); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("corpus.jsonl", "train.parquet", "test.parquet")}
    with open(paths["corpus.jsonl"], "w", encoding="utf-8") as f:
        for record in world.passages:
            f.write(json.dumps(record) + "\n")
    write_qa_parquet(paths["train.parquet"], world.train, split="train")
    write_qa_parquet(paths["test.parquet"], world.test, split="test")
    return paths
