"""Write a dialogue dataset: question/answer pairs about a small, consistent generated world.

A seeded world of people (each with one city, job, age, pet and favourite colour) and a
handful of skills give thousands of single-turn exchanges whose answers follow from the
question, so a small Transformer can learn them and be checked on questions it never saw:

* greetings   "Hello, I am Maya." -> "Nice to meet you, Maya!"; "What is your name?" and the
              like, each asked in several ways, always answered the same way;
* people      "Where does Omar live?" / "Which city is Omar from?" -> "Omar lives in Lima."
              (every fact is asked in several wordings: validation asks other wordings of
              facts that training saw, and other people's facts);
* numbers     "What comes after 41?" -> "42 comes after 41."; "Which is bigger, 7 or 12?" ->
              "12 is bigger than 7."; "What is 3 plus 4?" -> "3 plus 4 is 7.";
* echo        "Repeat after me: red apple tree" -> "red apple tree" (copying unseen sequences).

Every pair is its own conversation (``<category>-<number>``), so the trainer's split may put
two wordings of one question on the two sides: the answer must then come from what the
model learnt, not from the question's words. The output format follows the file name:
``.tsv`` (a header line ``question TAB response TAB conversation``, then one pair per line)
or ``.jsonl`` ({"question": ..., "response": ..., "conversation": ...} per line). Same
arguments, same bytes.

Usage: python -m include.sample_data.dialogue --out pairs.tsv [--people 120] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

NAMES = (
    "Ada Alan Amir Ana Anya Ari Ben Bo Cara Chen Dan Dara Eli Ella Emil Eva Finn Gia Hana Hugo Ida Ines "
    "Ivan Jade Jon Kai Kim Lea Leo Lin Lola Luca Maya Mia Milo Nia Nico Nina Noah Nora Olga Omar Otto "
    "Paul Petra Quinn Rafa Raj Rosa Ruth Sam Sara Sean Sofia Tara Theo Tom Uma Vera Wen Xena Yara Yusuf "
    "Zoe Zara Arlo Bea Cleo Dev Esme Felix Greta Hal Iris Jules Kofi Lars Mara Ned Oona"
).split()
CITIES = (
    "Paris Lima Oslo Cairo Tokyo Delhi Lagos Rome Berlin Madrid Dublin Quito Seoul Hanoi Nairobi Sydney "
    "Toronto Vienna Prague Lisbon Athens Bogota Dakar Manila Riga Tunis Kyoto Porto Accra Denver"
).split()
JOBS = (
    "teacher doctor baker pilot farmer nurse painter chef writer singer lawyer dentist plumber "
    "engineer gardener tailor judge sailor dancer builder"
).split()
PETS = "cat dog parrot rabbit hamster turtle goldfish horse lizard snake".split()
COLOURS = "red blue green yellow purple orange black white pink brown".split()
WORDS = (
    "apple river stone cloud tree house light music paper window garden winter summer bread "
    "candle mountain forest ocean silver golden little quiet happy bright dark old new small big "
    "fast slow warm cold soft loud green blue red yellow morning evening night road bridge"
).split()

PERSON_QUESTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "city": (
        (
            "Where does {name} live?",
            "Which city is {name} from?",
            "In which city does {name} live?",
            "Where is {name} from?",
            "Tell me where {name} lives.",
        ),
        "{name} lives in {city}.",
    ),
    "job": (
        (
            "What does {name} do?",
            "What is the job of {name}?",
            "What does {name} work as?",
            "Tell me what {name} does for a living.",
        ),
        "{name} works as a {job}.",
    ),
    "age": (
        ("How old is {name}?", "What is the age of {name}?", "Tell me how old {name} is."),
        "{name} is {age} years old.",
    ),
    "pet": (
        (
            "What pet does {name} have?",
            "Does {name} have a pet?",
            "Which animal does {name} keep?",
            "Tell me about the pet of {name}.",
        ),
        "{name} has a {pet}.",
    ),
    "colour": (
        (
            "What is the favourite colour of {name}?",
            "Which colour does {name} like best?",
            "What colour does {name} like?",
        ),
        "The favourite colour of {name} is {colour}.",
    ),
}

SMALL_TALK: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("Hello", "Hello!", "Hi", "Hi there", "Hey", "Good morning", "Good evening", "Hello there"),
        "Hello! How can I help you?",
    ),
    (
        ("What is your name?", "Who are you?", "What are you called?", "Tell me your name.", "Your name?"),
        "My name is Kubot, a small chat model.",
    ),
    (
        ("How are you?", "How are you doing?", "How is it going?", "Are you well?"),
        "I am fine, thank you. How are you?",
    ),
    (
        ("What is AI?", "What is artificial intelligence?", "Tell me what AI is.", "Explain AI."),
        "AI is the study of machines that learn from data.",
    ),
    (
        ("Thank you", "Thanks", "Thanks a lot", "Thank you very much"),
        "You are welcome!",
    ),
    (
        ("Goodbye", "Bye", "See you later", "Good night", "Bye bye"),
        "Goodbye! Talk to you soon.",
    ),
    (
        ("What can you do?", "How can you help me?", "What do you know?"),
        "I can answer questions about people, numbers and words.",
    ),
)
INTRODUCTIONS = ("Hello, I am {name}.", "Hi, my name is {name}.", "My name is {name}.", "I am {name}.")
NUMBER_LIMIT = 60
DEFAULT_PEOPLE = 80
DEFAULT_SEED = 7
CATEGORIES = ("greetings", "people", "numbers", "echo")


def greetings(rng: random.Random, people: list[dict[str, str]]) -> list[tuple[str, str]]:
    """Small talk in every wording, and introductions of every name."""
    pairs = [(q, a) for questions, a in SMALL_TALK for q in questions]
    pairs += [(t.format(name=n), f"Nice to meet you, {n}!") for n in NAMES for t in INTRODUCTIONS]
    return pairs


def people_facts(rng: random.Random, people: list[dict[str, str]]) -> list[tuple[str, str]]:
    """Every fact of every person, in every wording of its question."""
    return [
        (question.format(**person), answer.format(**person))
        for person in people
        for questions, answer in PERSON_QUESTIONS.values()
        for question in questions
    ]


def numbers(rng: random.Random, people: list[dict[str, str]]) -> list[tuple[str, str]]:
    """Successors, comparisons and small sums."""
    pairs = []
    for n in range(NUMBER_LIMIT):
        pairs.append((f"What comes after {n}?", f"{n + 1} comes after {n}."))
        pairs.append((f"What number follows {n}?", f"{n + 1} comes after {n}."))
    for a in range(NUMBER_LIMIT // 2):
        for b in range(NUMBER_LIMIT // 2):
            if a != b and rng.random() < 0.5:
                pairs.append((f"Which is bigger, {a} or {b}?", f"{max(a, b)} is bigger than {min(a, b)}."))
            if a <= 12 and b <= 12:
                pairs.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
    return pairs


def echo(rng: random.Random, people: list[dict[str, str]]) -> list[tuple[str, str]]:
    """Copy two to five words back."""
    pairs = []
    for _ in range(1500):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        pairs.append((f"Repeat after me: {words}", words))
    return pairs


GENERATORS: dict[str, Callable[[random.Random, list[dict[str, str]]], list[tuple[str, str]]]] = {
    "greetings": greetings,
    "people": people_facts,
    "numbers": numbers,
    "echo": echo,
}


def make_people(rng: random.Random, count: int) -> list[dict[str, str]]:
    """``count`` people with distinct names and one value of each attribute."""
    return [
        {
            "name": name,
            "city": rng.choice(CITIES),
            "job": rng.choice(JOBS),
            "age": str(rng.randint(18, 80)),
            "pet": rng.choice(PETS),
            "colour": rng.choice(COLOURS),
        }
        for name in NAMES[:count]
    ]


def generate(
    categories: list[str] | None = None, people: int = DEFAULT_PEOPLE, seed: int = DEFAULT_SEED
) -> list[tuple[str, str, str]]:
    """(question, response, conversation id) triples, shuffled with ``seed``; each pair is its own conversation."""
    rng = random.Random(seed)
    world = make_people(rng, people)
    triples = []
    for category in categories or list(CATEGORIES):
        for number, (question, answer) in enumerate(GENERATORS[category](rng, world), 1):
            triples.append((question, answer, f"{category}-{number}"))
    rng.shuffle(triples)
    return triples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.sample_data.dialogue",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path, help="file to write: .tsv or .jsonl")
    parser.add_argument(
        "--categories",
        default="",
        help=f"comma-separated categories among {', '.join(CATEGORIES)} (default: all)",
    )
    parser.add_argument(
        "--people",
        type=int,
        default=DEFAULT_PEOPLE,
        help=f"people in the generated world, 1 to {len(NAMES)} (default: {DEFAULT_PEOPLE})",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed (default: {DEFAULT_SEED})")
    args = parser.parse_args(argv)
    suffix = args.out.suffix.lower()
    if suffix not in (".tsv", ".jsonl"):
        parser.error(f"--out must end in .tsv or .jsonl, got {str(args.out)!r}")
    if not 1 <= args.people <= len(NAMES):
        parser.error(f"--people must be an integer from 1 to {len(NAMES)}, got {args.people}")
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        parser.error(f"--categories {','.join(unknown)} unknown; expected some of {', '.join(CATEGORIES)}")
    triples = generate(categories, args.people, args.seed)
    if suffix == ".tsv":
        text = "question\tresponse\tconversation\n" + "".join(f"{q}\t{r}\t{c}\n" for q, r, c in triples)
    else:
        text = "".join(
            json.dumps({"question": q, "response": r, "conversation": c}, ensure_ascii=False) + "\n"
            for q, r, c in triples
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {len(triples)} question/response pairs ({', '.join(categories or CATEGORIES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
