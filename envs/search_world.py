"""The generator of the shipped SearchQA data: a small invented world, its passages and its questions.

Everything is fictional (names are built from syllables with a fixed seed), so a model cannot answer
from memory and must search: 8 regions, 8 mountains, 12 rivers, 40 towns, 60 people (a biography
and a passage on their best-known work each), 60 works and 30 organisations, 278 passages in all.
Questions (120) follow HotpotQA's kinds: bridge questions (two hops: the question names one entity, the
answer is in the passage of another), comparisons and yes/no questions over two named entities, and
single-hop lookups. Each question lists its ``gold_ids`` (every supporting passage) and
``named_ids`` (the supporting passages of entities the question names, which a search with the
question's words should find).

``python -m envs.search_world`` rewrites ``envs/data/search_corpus.jsonl`` and
``envs/data/search_questions.jsonl``; ``tests/envs/test_search_qa.py`` checks the shipped files are
exactly this output.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CORPUS_PATH = os.path.join(DATA_DIR, "search_corpus.jsonl")
QUESTIONS_PATH = os.path.join(DATA_DIR, "search_questions.jsonl")
SEED = 2026

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "st",
          "th", "tr", "sk", "vr", "ch"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "io", "ou"]
CODAS = ["", "n", "r", "l", "s", "th", "nd", "rk", "m", "x"]
PROFESSIONS = ["painter", "engineer", "composer", "botanist", "astronomer", "architect", "poet", "cartographer"]
WORK_KIND = {"painter": "painting", "engineer": "bridge", "composer": "symphony", "botanist": "field guide",
             "astronomer": "star catalogue", "architect": "library", "poet": "collection of poems",
             "cartographer": "atlas"}
ORG_KINDS = ["shipyard", "observatory", "orchestra", "printing house", "seed bank", "glassworks"]
CLIMATES = ["cold and windy", "mild and rainy", "dry and hot", "humid", "snowy in winter", "foggy", "temperate",
            "arid"]


class _Names:
    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set()

    def make(self, syllables: int) -> str:
        while True:
            word = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(syllables))
            word = (word + self.rng.choice(CODAS)).capitalize()
            if word not in self.used and len(word) > 3:
                self.used.add(word)
                return word


def _world(rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    names = _Names(rng)
    mountains = [{"name": "Mount " + names.make(2), "height": rng.randrange(1800, 5200)} for _ in range(8)]
    rivers = [{"name": names.make(2) + " River", "length": rng.randrange(80, 900),
               "source": rng.choice(mountains)["name"]} for _ in range(12)]
    regions = [{"name": names.make(3), "climate": CLIMATES[i]} for i in range(8)]
    towns = [{"name": names.make(rng.choice([2, 3])), "region": regions[i % 8]["name"],
              "river": rng.choice(rivers)["name"], "founded": rng.randrange(900, 1700),
              "population": rng.randrange(2, 400) * 1000} for i in range(40)]
    for region, town in zip(regions, towns):
        region["capital"] = town["name"]
    people = [{"name": f"{names.make(2)} {names.make(2)}", "profession": PROFESSIONS[i % len(PROFESSIONS)],
               "born": rng.randrange(1700, 1960), "birthplace": rng.choice(towns)["name"]} for i in range(60)]
    works = []
    for person in people:
        work = {"name": "The " + names.make(2) + " " + rng.choice(["Suite", "Cycle", "Study", "Works", "Edition"]),
                "kind": WORK_KIND[person["profession"]], "creator": person["name"]}
        work["year"] = person["born"] + rng.randrange(22, 60)
        person["work"] = work["name"]
        works.append(work)
    orgs = [{"name": f"{names.make(2)} {ORG_KINDS[i % len(ORG_KINDS)].title()}", "kind": ORG_KINDS[i % len(ORG_KINDS)],
             "founder": people[(7 * i) % len(people)]["name"], "hq": rng.choice(towns)["name"]} for i in range(30)]
    for org in orgs:
        founder = next(p for p in people if p["name"] == org["founder"])
        org["founded"] = founder["born"] + rng.randrange(25, 55)
    return {"mountains": mountains, "rivers": rivers, "regions": regions, "towns": towns, "people": people,
            "works": works, "orgs": orgs}


def _passages(w: dict[str, list[dict[str, Any]]]) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The passages and a map entity name -> id of its main passage."""
    out: list[dict[str, str]] = []
    ids: dict[str, str] = {}

    def add(key: str, title: str, text: str, main: bool = True) -> None:
        pid = f"{key}-{len(out):03d}"
        out.append({"id": pid, "title": title, "text": text})
        if main:
            ids[title] = pid

    for m in w["mountains"]:
        add("mountain", m["name"], f"{m['name']} is a peak of {m['height']} metres. Its slopes are covered "
            "in pine forest below the tree line, and shepherds use its high meadows in summer.")
    for r in w["rivers"]:
        add("river", r["name"], f"The {r['name']} rises on {r['source']} and runs for about {r['length']} "
            "kilometres before it reaches the sea. Barges carried timber and grain along it for centuries.")
    for g in w["regions"]:
        add("region", g["name"], f"{g['name']} is a region whose climate is {g['climate']}. Its capital and "
            f"seat of the regional council is {g['capital']}.")
    for t in w["towns"]:
        add("town", t["name"], f"{t['name']} is a town in the region of {t['region']}, founded in {t['founded']}. "
            f"It lies on the banks of the {t['river']} and has about {t['population']} inhabitants.")
    for p in w["people"]:
        article = "an" if p["profession"][0] in "aeiou" else "a"
        add("person", p["name"], f"{p['name']} (born {p['born']}) was {article} {p['profession']} born in {p['birthplace']}. "
            f"Critics remember {p['name'].split()[1]} for a patient, exacting way of working.")
    for p in w["people"]:
        add("career", p["name"] + " (career)", f"The career of {p['name']} is best known for {p['work']}. "
            f"{p['name'].split()[1]} taught apprentices and wrote letters about the craft.",
            main=False)
    for k in w["works"]:
        add("work", k["name"], f"{k['name']} is a {k['kind']} by {k['creator']}, completed in {k['year']}. "
            "It was first shown to the public a year later and has been restored twice.")
    for o in w["orgs"]:
        add("org", o["name"], f"The {o['name']} is a {o['kind']} founded in {o['founded']} by {o['founder']}. "
            f"Its headquarters are in {o['hq']}.")
    return out, ids


def _questions(w: dict[str, list[dict[str, Any]]], ids: dict[str, str], rng: random.Random) -> list[dict[str, Any]]:
    people = {p["name"]: p for p in w["people"]}
    towns = {t["name"]: t for t in w["towns"]}
    qs: list[dict[str, Any]] = []

    def add(kind: str, question: str, answer: str, gold: list[str], named: list[str]) -> None:
        qs.append({"id": f"q{len(qs):03d}", "type": kind, "question": question, "answer": answer,
                   "gold_ids": gold, "named_ids": named})

    for o in rng.sample(w["orgs"], 25):
        founder = people[o["founder"]]
        add("bridge", f"In which town was the founder of the {o['name']} born?", founder["birthplace"],
            [ids[o["name"]], ids[founder["name"]]], [ids[o["name"]]])
    for p in rng.sample(w["people"], 25):
        town = towns[p["birthplace"]]
        add("bridge", f"Which river flows through the birthplace of {p['name']}?", town["river"],
            [ids[p["name"]], ids[town["name"]]], [ids[p["name"]]])
    for k in rng.sample(w["works"], 20):
        creator = people[k["creator"]]
        add("bridge", f"In what year was the creator of {k['name']} born?", str(creator["born"]),
            [ids[k["name"]], ids[creator["name"]]], [ids[k["name"]]])
    for _ in range(20):
        a, b = rng.sample(w["orgs"], 2)
        if a["founded"] == b["founded"]:
            continue
        first = a if a["founded"] < b["founded"] else b
        add("comparison", f"Which was founded earlier, the {a['name']} or the {b['name']}?", first["name"],
            [ids[a["name"]], ids[b["name"]]], [ids[a["name"]], ids[b["name"]]])
    for i in range(20):
        a, b = rng.sample(w["towns"], 2)
        if i % 2 == 0:  # half the pairs share a river, so "yes" and "no" are both common answers
            same = [t for t in w["towns"] if t["river"] == a["river"] and t is not a]
            b = same[0] if same else b
        answer = "yes" if a["river"] == b["river"] else "no"
        add("yesno", f"Do {a['name']} and {b['name']} lie on the same river?", answer,
            [ids[a["name"]], ids[b["name"]]], [ids[a["name"]], ids[b["name"]]])
    for t in rng.sample(w["towns"], 10):
        add("single", f"In which region is the town of {t['name']}?", t["region"], [ids[t["name"]]], [ids[t["name"]]])
    return qs


def build() -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """(passages [{"id", "title", "text"}], questions [{"id", "type", "question", "answer", "gold_ids",
    "named_ids"}]), the same on every call."""
    rng = random.Random(SEED)
    world = _world(rng)
    passages, ids = _passages(world)
    return passages, _questions(world, ids, rng)


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    passages, questions = build()
    _write_jsonl(CORPUS_PATH, passages)
    _write_jsonl(QUESTIONS_PATH, questions)
    print(f"{len(passages)} passages -> {CORPUS_PATH}\n{len(questions)} questions -> {QUESTIONS_PATH}")
