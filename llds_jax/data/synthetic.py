"""A generated search world: fictional people with attributes, written as wiki-18 passages, and questions whose
answers are only in the corpus (deterministic from a seed; no downloads).

Each person has a birthplace, an occupation and an employer (a fictional company). Passages follow wiki-18's shape
(`"Title"\\nbody`): one per person, one per company. Questions are single-hop ("Where was X born?") and two-hop
("Where was the founder of Y born?": the company passage names its founder, whose passage names the city).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random

from llds_jax.data.qa import QAExample, write_qa_parquet

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
CITIES = ("Veltra", "Moskar", "Dunhelm", "Ashbury", "Corvane", "Pelmora", "Tristane", "Halvik", "Orsino", "Quenby")
OCCUPATIONS = ("painter", "chemist", "sailor", "architect", "violinist", "astronomer", "baker", "surgeon")


@dataclasses.dataclass(frozen=True)
class Person:
    name: str
    city: str
    occupation: str
    company: str


@dataclasses.dataclass(frozen=True)
class World:
    """People, companies (name -> founder name), passages (wiki-18 records) and QA splits."""

    people: tuple[Person, ...]
    founders: dict[str, str]
    passages: tuple[dict, ...]
    train: tuple[QAExample, ...]
    test: tuple[QAExample, ...]


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        if word not in used:
            used.add(word)
            return word.capitalize()


def make_world(num_people: int = 200, seed: int = 0, test_fraction: float = 0.2) -> World:
    """A world of `num_people` people and num_people // 4 companies; questions split by person into train/test."""
    rng = random.Random(seed)
    used: set[str] = set()
    companies = [_name(rng, used) + " Works" for _ in range(max(1, num_people // 4))]
    people = tuple(Person(name=f"{_name(rng, used)} {_name(rng, used)}", city=rng.choice(CITIES),
                          occupation=rng.choice(OCCUPATIONS), company=rng.choice(companies))
                   for _ in range(num_people))
    founders = {company: people[i % num_people].name for i, company in enumerate(companies)}
    passages = [{"contents": f'"{p.name}"\n{p.name} is a {p.occupation} born in {p.city}. '
                             f'{p.name} works for {p.company}.'} for p in people]
    passages += [{"contents": f'"{c}"\n{c} is a company founded by {founder}.'} for c, founder in founders.items()]
    passages = tuple({"id": str(i), **record} for i, record in enumerate(passages))
    questions = []
    for i, p in enumerate(people):
        questions.append((i, f"Where was {p.name} born?", p.city, "single_hop"))
        questions.append((i, f"What is the occupation of {p.name}?", p.occupation, "single_hop"))
    by_founder = {founder: c for c, founder in founders.items()}
    for i, p in enumerate(people):
        if p.name in by_founder:
            questions.append((i, f"Where was the founder of {by_founder[p.name]} born?", p.city, "two_hop"))
    test_people = set(rng.sample(range(num_people), max(1, int(num_people * test_fraction))))
    split = {"train": [], "test": []}
    for person, question, answer, source in questions:
        name = "test" if person in test_people else "train"
        split[name].append(QAExample(uid=f"{name}-{len(split[name])}", question=question, golden_answers=(answer,),
                                     data_source=source, id=f"{name}_{len(split[name])}"))
    return World(people=people, founders=founders, passages=passages, train=tuple(split["train"]),
                 test=tuple(split["test"]))


def write_world(world: World, out_dir: str) -> dict[str, str]:
    """Writes corpus.jsonl, train.parquet and test.parquet (Search-R1 schema); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("corpus.jsonl", "train.parquet", "test.parquet")}
    with open(paths["corpus.jsonl"], "w", encoding="utf-8") as f:
        for record in world.passages:
            f.write(json.dumps(record) + "\n")
    write_qa_parquet(paths["train.parquet"], world.train, split="train")
    write_qa_parquet(paths["test.parquet"], world.test, split="test")
    return paths
