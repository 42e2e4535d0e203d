"""A generated world that needs a long horizon: k-hop questions (k = 1..6) over fictional people, companies and
cities, each answerable only by k searches (deterministic from a seed; no downloads). Beside today's single-/two-hop
world (llds_jax.data.synthetic), which it leaves as it is; the demo builds it with `demo.world = "khop"`
(llds_jax.apps.demo, configs/demo_cpu_deep.py).

Entities and their relations, each a function (one object per subject):

    person  -> mentor (a person), employer (a company), birthplace (a city), occupation (a word of OCCUPATIONS)
    company -> founder (a person), headquarters (a city)
    city    -> mayor (a person)

Each fact is written only in its subject's passage (wiki-18's `"Title"\\nbody`: "A is a baker born in Veltra. A was
mentored by B. A works for C."); the mentor is directed, as a spouse would not be (a symmetric relation's fact is
written in both partners' passages). A question names one person and composes k relations ("Where was the founder of
the company that employs the mentor of Mopaka Tiru born?"); its hops are the k entities whose passages hold the
chain's facts (Mopaka Tiru, the mentor, the company, the founder: k = 4), searched by name in that order. Chains are
drawn so that among the chain's passages each hop's entity is named only in its own passage and the one before it,
and the answer only in the last (and the question names only the first): the j-th search needs the name that only
the (j-1)-th search's passage gives, the answer is in the k-th's alone, and a search for a hop's name finds no later
passage of the chain by that name. Entities on a chain are distinct.

Train and test hold different people's questions (by the person a question names, as today's world); the test
split has the same number of questions for each k. The world has the fields that `synthetic.demonstrations`
(the imperfect demonstrator's warm-start transcripts), `synthetic.tokenizer_texts` and `synthetic.write_world`
read (`synthetic.SearchWorld`), and is used through them.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import random

from llds_jax.data.qa import QAExample
from llds_jax.data.synthetic import COMPANY_SUFFIXES, OCCUPATIONS, combined_names, generated_name

MAX_HOPS = 6
MIN_PEOPLE = 20  # the fewest people of a world (make_khop_world)
# relation -> (the kind of its subject, the kind of its object, its phrase around the subject's in a question,
# the question it asks as the chain's last relation)
RELATIONS = {
    "mentor": ("person", "person", "the mentor of {}", "Who mentored {}?"),
    "employer": ("person", "company", "the company that employs {}", "Which company employs {}?"),
    "birthplace": ("person", "city", "the birthplace of {}", "Where was {} born?"),
    "occupation": ("person", "occupation", "the occupation of {}", "What is the occupation of {}?"),
    "founder": ("company", "person", "the founder of {}", "Who founded {}?"),
    "headquarters": ("company", "city", "the city where {} is headquartered", "Where is {} headquartered?"),
    "mayor": ("city", "person", "the mayor of {}", "Who is the mayor of {}?"),
}
# A passage's body per subject kind: its facts' objects by relation name, the subject as {subject}.
PASSAGES = {
    "person": "{subject} is {article} {occupation} born in {birthplace}. {subject} was mentored by {mentor}. "
              "{subject} works for {employer}.",
    "company": "{subject} is a company founded by {founder}. {subject} is headquartered in {headquarters}.",
    "city": "{subject} is a city whose mayor is {mayor}.",
}
_TRIES = 32  # chains drawn for a (person, k) before it is left without a question


@dataclasses.dataclass(frozen=True)
class KHopWorld:
    """Entities (name -> "person", "company" or "city"), facts ((subject, relation) -> object name or occupation),
    passages (wiki-18 records), QA splits, and per question: the relations of its chain from the person it names
    (k of them), the searches that answer it (the k entities whose passages hold the chain's facts, in order) and
    the answers of its kind (the demonstrator's guesses)."""

    kinds: dict[str, str]
    facts: dict[tuple[str, str], str]
    passages: tuple[dict, ...]
    train: tuple[QAExample, ...]
    test: tuple[QAExample, ...]
    chains: dict[str, tuple[str, ...]]
    hops: dict[str, tuple[str, ...]]
    choices: dict[str, tuple[str, ...]]


def make_khop_world(num_people: int = 200, seed: int = 0, test_fraction: float = 0.2) -> KHopWorld:
    """A world of `num_people` people, num_people // 4 companies and num_people // 10 cities, with one question
    per person and k = 1..MAX_HOPS where a sound chain was drawn (in a few tries; nearly always); questions split
    by the person they name, the test split cut to the same count for every k.

    Names are built as today's world's (`synthetic.make_world`): a person "First Last" from two pools of about
    sqrt(1.5 * num_people) generated words, a company "Prefix Suffix", a city one generated word; every part is
    shared by many passages, so a tokenizer trained on the world keeps each as one whole-word token.
    """
    if num_people < MIN_PEOPLE:
        raise ValueError(f"make_khop_world: num_people must be at least {MIN_PEOPLE}, got {num_people}")
    rng = random.Random(seed)
    used: set[str] = set()
    num_companies, num_cities = num_people // 4, num_people // 10
    companies = combined_names(rng, used, num_companies, -(-num_companies // len(COMPANY_SUFFIXES)) + 1,
                               COMPANY_SUFFIXES)
    cities = [generated_name(rng, used) for _ in range(num_cities)]
    pool = math.ceil(math.sqrt(1.5 * num_people))
    people = combined_names(rng, used, num_people, pool, [generated_name(rng, used) for _ in range(pool)])
    facts: dict[tuple[str, str], str] = {}
    for i, person in enumerate(people):
        facts[person, "occupation"] = rng.choice(OCCUPATIONS)
        facts[person, "birthplace"] = rng.choice(cities)
        facts[person, "mentor"] = people[(i + rng.randrange(1, num_people)) % num_people]
        facts[person, "employer"] = rng.choice(companies)
    for company, founder in zip(companies, rng.sample(people, num_companies)):
        facts[company, "founder"] = founder
        facts[company, "headquarters"] = rng.choice(cities)
    for city, mayor in zip(cities, rng.sample(people, num_cities)):
        facts[city, "mayor"] = mayor
    kinds = {**{p: "person" for p in people}, **{c: "company" for c in companies}, **{c: "city" for c in cities}}
    relations: dict[str, dict[str, str]] = {name: {} for name in kinds}
    for (subject, relation), obj in facts.items():
        relations[subject][relation] = obj
    passages = tuple({"id": str(i), "contents": _passage(name, kinds[name], objects)}
                     for i, (name, objects) in enumerate(relations.items()))
    mentions = {name: {name, *rel.values()} for name, rel in relations.items()}
    answers_of_kind = {"person": tuple(people), "company": tuple(companies), "city": tuple(cities),
                       "occupation": OCCUPATIONS}
    questions = []  # (k, person, question, answer)
    chains, hops, choices = {}, {}, {}
    for k in range(1, MAX_HOPS + 1):
        for person in people:
            drawn = _draw_chain(rng, person, k, relations, mentions)
            if drawn is None:
                continue
            path, searches, answer = drawn
            question = _question(person, path)
            questions.append((k, person, question, answer))
            chains[question], hops[question] = path, searches
            choices[question] = answers_of_kind[RELATIONS[path[-1]][1]]
    test_people = set(rng.sample(people, max(1, int(num_people * test_fraction))))
    test_counts = collections.Counter(k for k, person, _, _ in questions if person in test_people)
    per_k = min(test_counts[k] for k in range(1, MAX_HOPS + 1))
    split: dict[str, list[QAExample]] = {"train": [], "test": []}
    taken = {k: 0 for k in range(1, MAX_HOPS + 1)}
    for k, person, question, answer in questions:
        if person in test_people:
            if taken[k] == per_k:
                del chains[question], hops[question], choices[question]
                continue
            taken[k] += 1
        name = "test" if person in test_people else "train"
        split[name].append(QAExample(uid=f"{name}-{len(split[name])}", question=question, golden_answers=(answer,),
                                     data_source=f"hop_{k}", id=f"{name}_{len(split[name])}"))
    return KHopWorld(kinds=kinds, facts=facts, passages=passages, train=tuple(split["train"]),
                     test=tuple(split["test"]), chains=chains, hops=hops, choices=choices)


def _passage(name: str, kind: str, objects: dict[str, str]) -> str:
    """The wiki-18 record of entity `name` of `kind` whose facts' objects are `objects` (by relation)."""
    if kind == "person":
        objects = {**objects, "article": "an" if objects["occupation"][0] in "aeiou" else "a"}
    return f'"{name}"\n' + PASSAGES[kind].format(subject=name, **objects)


def _draw_chain(rng: random.Random, person: str, k: int,
                relations: dict[str, dict[str, str]], mentions: dict[str, set[str]]
                ) -> tuple[tuple[str, ...], tuple[str, ...], str] | None:
    """A random chain of k relations from `person` (relations, the k entities searched, the answer) whose
    entities are distinct and each named, among the chain's passages, only in its own and the one before it (the
    answer only in the last); None when `_TRIES` draws give none."""
    for _ in range(_TRIES):
        path, names = [], [person]
        for hop in range(k):
            options = [r for r in relations[names[-1]] if hop == k - 1 or RELATIONS[r][1] != "occupation"]
            relation = rng.choice(options)
            path.append(relation)
            names.append(relations[names[-1]][relation])
        searched = names[:-1]
        if len(set(names)) == len(names) and all(
                names[n] not in mentions[searched[i]] for n in range(k + 1) for i in range(k) if i not in (n - 1, n)):
            return tuple(path), tuple(searched), names[-1]
    return None


def _question(person: str, path: tuple[str, ...]) -> str:
    """The question that composes `path`'s relation phrases around `person`: the last relation's question about
    the phrase of the others ("Where was the founder of the company that employs X born?")."""
    phrase = person
    for relation in path[:-1]:
        phrase = RELATIONS[relation][2].format(phrase)
    return RELATIONS[path[-1]][3].format(phrase)
