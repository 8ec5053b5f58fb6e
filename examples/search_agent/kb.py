"""A seeded synthetic knowledge base of made-up people and towns, its search engine, and the
questions whose answers need it.

    kb = KnowledgeBase.build(seed=1, people=200)
    engine = SearchEngine(kb)           # BM25 (the `bm25s` library) over every document
    engine.search("Vorlan Quess")       # 'd0042 Vorlan Quess: Vorlan Quess is a painter.\n...'
    engine.read("d0042")                # the whole document
    train, held_out = questions(kb, num_train=400, num_eval=100, seed=1)

Names are syllable strings no model has seen, so an answer cannot come from memory: a person's
birthplace and birth year are in that person's document, a town's region in the town's. One-hop
questions ask for a birthplace or year (search the person, read the document); two-hop ones ask
for the region a person was born in (then search and read the town). Held-out questions are about
people no training question names. Search snippets are a document's first sentence, which never
holds an answer: the agent must read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import Any

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "qu", "st", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "x", "m", "nd"]
PROFESSIONS = ["painter", "baker", "sailor", "weaver", "miner", "poet", "smith", "farmer", "doctor", "judge"]
REGIONS = ["Mirvale", "Droskar", "Elund", "Temberra", "Quillan", "Saphor"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).title()


@dataclass(frozen=True)
class Doc:
    doc_id: str
    title: str
    text: str

    @property
    def snippet(self) -> str:
        return self.text.split(". ", 1)[0].rstrip(".") + "."


@dataclass(frozen=True)
class Person:
    name: str
    profession: str
    town: str
    year: int
    doc_id: str


@dataclass(frozen=True)
class Town:
    name: str
    region: str
    people_k: int
    doc_id: str


@dataclass
class KnowledgeBase:
    seed: int
    people: list[Person]
    towns: list[Town]

    @classmethod
    def build(cls, seed: int = 1, people: int = 200, towns: int = 0) -> KnowledgeBase:
        """`people` people born in `towns` towns (default: people // 5); names unique across both."""
        rng = random.Random(f"kb-{seed}")
        n_towns = towns or max(4, people // 5)
        taken: set[str] = set()

        def fresh(make) -> str:
            while (name := make()) in taken or len(name) < 4:
                pass
            taken.add(name)
            return name

        order = list(range(people + n_towns))
        rng.shuffle(order)  # document ids are not a give-away of the entity's kind
        ids = [f"d{k:04d}" for k in order]
        town_list = [
            Town(fresh(lambda: _word(rng, 2)), rng.choice(REGIONS), rng.randint(2, 90), ids[people + t])
            for t in range(n_towns)
        ]
        person_list = [
            Person(
                fresh(lambda: f"{_word(rng, rng.randint(1, 2))} {_word(rng, 2)}"),
                rng.choice(PROFESSIONS),
                rng.choice(town_list).name,
                rng.randint(1700, 1999),
                ids[p],
            )
            for p in range(people)
        ]
        return cls(seed, person_list, town_list)

    @cached_property
    def docs(self) -> dict[str, Doc]:
        out = {}
        for p in self.people:
            text = f"{p.name} is a {p.profession}. {p.name} was born in {p.town} in {p.year}."
            out[p.doc_id] = Doc(p.doc_id, p.name, text)
        for t in self.towns:
            text = f"{t.name} is a town of {t.people_k} thousand people. {t.name} lies in the region of {t.region}."
            out[t.doc_id] = Doc(t.doc_id, t.name, text)
        return dict(sorted(out.items()))

    @cached_property
    def town(self) -> dict[str, Town]:
        return {t.name: t for t in self.towns}


class SearchEngine:
    """BM25 over the documents (title and text), with the `bm25s` library."""

    def __init__(self, kb: KnowledgeBase):
        import bm25s

        self.kb, self.ids = kb, list(kb.docs)
        texts = [f"{d.title}. {d.text}" for d in kb.docs.values()]
        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)

    def ranked(self, query: str, k: int = 3) -> list[str]:
        """The ids of the `k` best documents for `query`, best first; only documents sharing a word with it."""
        tokens = self._bm25s.tokenize([query[:500]], stopwords="en", return_ids=False, show_progress=False)
        docs, scores = self.retriever.retrieve(tokens, k=min(k, len(self.ids)), show_progress=False)
        return [self.ids[int(i)] for i, s in zip(docs[0], scores[0]) if s > 0]

    def search(self, query: str, k: int = 3) -> str:
        """One line per hit, `{doc id} {title}: {snippet}`; 'no results' when none."""
        hits = [self.kb.docs[i] for i in self.ranked(query, k)]
        return "\n".join(f"{d.doc_id} {d.title}: {d.snippet}" for d in hits) or "no results"

    def read(self, doc_id: str) -> str:
        doc = self.kb.docs.get(doc_id.strip())
        return doc.text if doc else f"error: no document {doc_id.strip()[:20]!r}"


def _question(kb: KnowledgeBase, p: Person, kind: str, split: str, k: int) -> dict[str, Any]:
    town = kb.town[p.town]
    if kind == "year":
        q, answer, steps = f"In which year was {p.name} born?", str(p.year), [(p.name, p.doc_id)]
    elif kind == "town":
        q, answer, steps = f"Where was {p.name} born?", p.town, [(p.name, p.doc_id)]
    else:
        q, answer, steps = (
            f"In which region was {p.name} born?",
            town.region,
            [(p.name, p.doc_id), (p.town, town.doc_id)],
        )
    return {
        "prompt_id": f"search-{split}-{k:05d}",
        "prompt": q + " Answer as #### <answer> [<doc id>].",
        "answer": answer,
        "meta": {
            "kind": kind,
            "hops": len(steps),
            "steps": steps,
            "support": steps[-1][1],
            "kb_seed": kb.seed,
            "kb_people": len(kb.people),
        },
    }


def questions(
    kb: KnowledgeBase, num_train: int, num_eval: int, seed: int = 1, kinds: tuple[str, ...] = ("town", "year", "region")
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training and held-out questions; held-out ones are about people no training question names."""
    rng = random.Random(f"questions-{seed}")
    people = list(kb.people)
    rng.shuffle(people)
    cut = max(1, len(people) * 4 // 5)
    out = []
    for split, pool, n in (("train", people[:cut], num_train), ("eval", people[cut:] or people, num_eval)):
        out.append([_question(kb, rng.choice(pool), rng.choice(kinds), split, k) for k in range(n)])
    return out[0], out[1]


# -- the GSM8K JSONL form (task.name gsm8k reads it: configs/agent_search.yaml) ---------------------
def to_row(q: dict[str, Any]) -> dict[str, str]:
    """A question as a `{question, answer}` line; the answer spells what the reward needs:
    `kb <seed> <people>; <entity> = <doc id>; ... #### <answer> [<support doc id>]`."""
    m = q["meta"]
    steps = "; ".join(f"{name} = {doc}" for name, doc in m["steps"])
    return {
        "question": q["prompt"],
        "answer": f"kb {m['kb_seed']} {m['kb_people']}; {steps} #### {q['answer']} [{m['support']}]",
    }


def from_record(record: dict[str, Any]) -> dict[str, Any]:
    """A question as `questions` gives it, from itself or from a record read from the JSONL form."""
    if "support" in (record.get("meta") or {}):
        return record
    head, _, final = str(record["answer"]).rpartition(" #### ")
    answer, _, support = final.rstrip("]").rpartition(" [")
    kb, *steps = head.split("; ")
    _, seed, people = kb.split()
    pairs = [tuple(s.rsplit(" = ", 1)) for s in steps]
    meta = {"hops": len(pairs), "steps": pairs, "support": support, "kb_seed": int(seed), "kb_people": int(people)}
    return {**record, "answer": answer, "meta": {**(record.get("meta") or {}), **meta}}
