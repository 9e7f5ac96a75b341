"""The bundled offline task set for ``hybrid-build eval``: items generated here, deterministically.

Three kinds of item, written for this project (no dataset is copied), each a four-way multiple
choice with one right answer, so that a model is scored by the log-likelihood of each choice:

- ``arith``: arithmetic word problems (one and two steps), distractors from the wrong operation
  and near misses;
- ``code``: the ``return`` expression of a small documented Python function, distractors that
  do something close but wrong;
- ``toolcall``: the JSON call that answers a request, given five tools; distractors call the wrong
  tool, change an argument's value or swap two arguments.

The files under ``validate/eval/eval_tasks/`` (lm-eval task YAML, the loader ``tasks.py`` and the
JSONL written here) ship with the package; the YAML tasks read the JSONL through the loader, so
no task needs the network. ``python -m hybrid_build.validate.eval.eval_taskset`` rewrites the JSONL
(byte for byte the same: a test checks it).
"""
from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

SEED = 20261201
COUNTS = {"arith": 120, "code": 100, "toolcall": 100}
TASK_FOLDER = "eval_tasks"
# lm-eval names: multiple choice (log-likelihood) and generative variants, and their groups
GROUPS = {"hybrid_build": ("hb_arith", "hb_code", "hb_toolcall"),
          "hybrid_build_gen": ("hb_arith_gen", "hb_code_gen", "hb_toolcall_gen")}
BUNDLED_TASKS = tuple(GROUPS) + GROUPS["hybrid_build"] + GROUPS["hybrid_build_gen"]


def task_dir() -> Path:
    """The folder of the bundled lm-eval tasks (the TaskManager's include path)."""
    return Path(str(resources.files("hybrid_build.validate.eval") / TASK_FOLDER))


# ------------------------------------------------------------------------------------ arithmetic

NAMES = ["Ada", "Ben", "Chloe", "Dev", "Eva", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Liam",
         "Mei", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
OBJECTS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "coins"]
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("crate", "crates"), ("jar", "jars"), ("tray", "trays")]


def _choices(rng: random.Random, answer: int, near: list[int]) -> tuple[list[str], int]:
    """Four distinct positive numbers: the answer and three distractors (from ``near`` first)."""
    picks: list[int] = []
    for v in near + [answer + 1, answer - 1, answer + 2, answer + 10, answer * 2, answer - 2, answer + 3]:
        if v > 0 and v != answer and v not in picks:
            picks.append(v)
        if len(picks) == 3:
            break
    values = [answer] + picks
    rng.shuffle(values)
    return [str(v) for v in values], values.index(answer)


def _arith(rng: random.Random, i: int) -> dict:
    kind = i % 6
    name, other = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    if kind == 0:
        a, b = rng.randint(3, 40), rng.randint(2, 30)
        q = f"{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?"
        ans, near = a + b, [abs(a - b), a * b]
    elif kind == 1:
        a = rng.randint(12, 60)
        b = rng.randint(2, a - 3)
        q = f"{name} had {a} {obj} and gave {b} of them to {other}. How many {obj} does {name} have left?"
        ans, near = a - b, [a + b, a - b + 1]
    elif kind == 2:
        box, boxes = rng.choice(CONTAINERS)
        a, b = rng.randint(3, 12), rng.randint(2, 9)
        q = f"One {box} holds {a} {obj}. How many {obj} are in {b} {boxes}?"
        ans, near = a * b, [a + b, a * (b - 1)]
    elif kind == 3:
        b, k = rng.randint(2, 9), rng.randint(2, 12)
        a = b * k
        q = f"{name} shares {a} {obj} equally among {b} friends. How many {obj} does each friend get?"
        ans, near = k, [a - b, k + b]
    elif kind == 4:
        packs, per, eaten = rng.randint(2, 8), rng.randint(3, 10), rng.randint(1, 9)
        q = (f"{name} buys {packs} packs with {per} {obj} in each pack, then loses {eaten} of them. "
             f"How many {obj} are left?")
        ans, near = packs * per - eaten, [packs * per, packs + per - eaten]
    else:
        speed, hours, extra = rng.randint(20, 90), rng.randint(2, 6), rng.randint(5, 40)
        q = (f"A train travels {speed} km every hour for {hours} hours, then {extra} km more. "
             f"How many km does it travel in all?")
        ans, near = speed * hours + extra, [speed * hours, speed + hours + extra]
    choices, label = _choices(rng, ans, near)
    return {"id": f"arith-{i:03d}", "question": q, "choices": choices, "label": label, "answer": str(ans)}


# ------------------------------------------------------------------------------------ code

NUM_ARGS = [("a", "b"), ("x", "y"), ("m", "n"), ("left", "right"), ("first", "second")]
LIST_ARGS = ["xs", "items", "values", "numbers", "data"]
STR_ARGS = ["s", "text", "word", "name", "line"]
# (base name, argument kinds, docstring, right expression, wrong expressions); {a} {b}: numbers,
# {xs}: a list, {s}: a string, {x}: an item
CODE_TEMPLATES = [
    ("add", "ab", "Return the sum of {a} and {b}.", "{a} + {b}", ["{a} - {b}", "{a} * {b}", "{b}"]),
    ("subtract", "ab", "Return {a} minus {b}.", "{a} - {b}", ["{b} - {a}", "{a} + {b}", "{a}"]),
    ("multiply", "ab", "Return the product of {a} and {b}.", "{a} * {b}", ["{a} + {b}", "{a} ** {b}", "{a} / {b}"]),
    ("square", "a", "Return {a} squared.", "{a} * {a}", ["{a} + {a}", "{a} ** 3", "{a} // 2"]),
    ("is_even", "a", "Return True if {a} is even.", "{a} % 2 == 0", ["{a} % 2 == 1", "{a} // 2 == 0", "{a} == 2"]),
    ("largest", "xs", "Return the largest item of {xs}.", "max({xs})", ["min({xs})", "{xs}[0]", "sorted({xs})"]),
    ("smallest", "xs", "Return the smallest item of {xs}.", "min({xs})", ["max({xs})", "{xs}[-1]", "len({xs})"]),
    ("count_items", "xs", "Return the number of items in {xs}.", "len({xs})", ["sum({xs})", "max({xs})", "{xs}[-1]"]),
    ("total", "xs", "Return the total of the numbers in {xs}.", "sum({xs})", ["len({xs})", "max({xs})", "{xs}[0]"]),
    ("first_item", "xs", "Return the first item of {xs}.", "{xs}[0]", ["{xs}[-1]", "{xs}[1]", "len({xs})"]),
    ("last_item", "xs", "Return the last item of {xs}.", "{xs}[-1]", ["{xs}[0]", "{xs}[1:]", "len({xs}) - 1"]),
    ("reverse", "s", "Return {s} reversed.", "{s}[::-1]", ["{s}[1:]", "sorted({s})", "{s}.upper()"]),
    ("shout", "s", "Return {s} in upper case.", "{s}.upper()", ["{s}.lower()", "{s}.title()", "{s}[::-1]"]),
    ("whisper", "s", "Return {s} in lower case.", "{s}.lower()", ["{s}.upper()", "{s}.strip()", "{s}[:-1]"]),
    ("mean", "xs", "Return the mean of the numbers in {xs}.", "sum({xs}) / len({xs})",
     ["sum({xs}) * len({xs})", "max({xs}) / 2", "len({xs}) / sum({xs})"]),
    ("magnitude", "a", "Return the absolute value of {a}.", "abs({a})", ["-{a}", "{a} * {a}", "int({a})"]),
    ("join_words", "xs", "Return the words in {xs} joined by single spaces.", "\" \".join({xs})",
     ["\",\".join({xs})", "\"\".join({xs})", "{xs}[0]"]),
    ("occurrences", "xsx", "Return how many times {x} occurs in {xs}.", "{xs}.count({x})",
     ["{xs}.index({x})", "len({xs})", "{x} in {xs}"]),
    ("contains", "xsx", "Return True if {x} is in {xs}.", "{x} in {xs}",
     ["{x} not in {xs}", "{xs}.count({x}) > 1", "{xs}[0] == {x}"]),
    ("half", "a", "Return half of {a} as a float.", "{a} / 2", ["{a} // 2", "{a} * 2", "{a} - 2"]),
]
NAME_STYLES = ["{}", "get_{}", "compute_{}", "{}_of", "calc_{}"]


def _code(rng: random.Random, i: int) -> dict:
    base, kinds, doc, right, wrong = CODE_TEMPLATES[i % len(CODE_TEMPLATES)]
    style = NAME_STYLES[(i // len(CODE_TEMPLATES)) % len(NAME_STYLES)]
    a, b = rng.choice(NUM_ARGS)
    names = {"a": a, "b": b, "xs": rng.choice(LIST_ARGS), "s": rng.choice(STR_ARGS), "x": "target"}
    params = {"ab": [a, b], "a": [a], "xs": [names["xs"]], "s": [names["s"]], "xsx": [names["xs"], "target"]}[kinds]
    fill = lambda t: t.format(**names)  # noqa: E731
    prompt = f"def {style.format(base)}({', '.join(params)}):\n    \"\"\"{fill(doc)}\"\"\"\n    return"
    values = [fill(right)] + [fill(w) for w in wrong]
    answer = values[0]
    rng.shuffle(values)
    return {"id": f"code-{i:03d}", "prompt": prompt, "choices": values, "label": values.index(answer),
            "answer": answer}


# ------------------------------------------------------------------------------------ tool calls

TOOLS_TEXT = """Tools:
- get_weather(city: string, unit: "celsius" | "fahrenheit")
- convert_currency(amount: number, from_currency: string, to_currency: string)
- set_timer(minutes: integer, label: string)
- search_flights(origin: string, destination: string, date: string YYYY-MM-DD)
- send_email(to: string, subject: string)
Answer with one JSON object {"name": ..., "arguments": {...}}."""
CITIES = ["Paris", "Lima", "Osaka", "Nairobi", "Oslo", "Quito", "Hanoi", "Dublin", "Perth", "Seville"]
CURRENCIES = ["EUR", "USD", "JPY", "GBP", "CHF", "INR"]
LABELS = ["pasta", "tea", "laundry", "bread", "meeting", "stretch"]
PEOPLE = ["ana@example.com", "bo@example.com", "cy@example.com", "dee@example.com"]
SUBJECTS = ["Lunch on Friday", "Quarterly report", "Trip photos", "Door code", "Invoice 42"]


def _call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def _toolcall(rng: random.Random, i: int) -> dict:
    kind = i % 5
    if kind == 0:
        city, city2 = rng.sample(CITIES, 2)
        unit, unit2 = rng.sample(["celsius", "fahrenheit"], 2)
        request = f"What is the weather in {city} right now, in {unit}?"
        right = _call("get_weather", city=city, unit=unit)
        wrong = [_call("get_weather", city=city2, unit=unit), _call("get_weather", city=city, unit=unit2),
                 _call("search_flights", origin=city, destination=city2, date="2027-01-01")]
    elif kind == 1:
        amount = rng.choice([5, 12, 20, 75, 100, 250, 999])
        src, dst, third = rng.sample(CURRENCIES, 3)
        request = f"How much is {amount} {src} in {dst}?"
        right = _call("convert_currency", amount=amount, from_currency=src, to_currency=dst)
        wrong = [_call("convert_currency", amount=amount, from_currency=dst, to_currency=src),
                 _call("convert_currency", amount=amount, from_currency=src, to_currency=third),
                 _call("convert_currency", amount=amount * 10, from_currency=src, to_currency=dst)]
    elif kind == 2:
        minutes, label = rng.randint(2, 45), rng.choice(LABELS)
        label2 = rng.choice([x for x in LABELS if x != label])
        request = f"Set a {minutes} minute timer for the {label}."
        right = _call("set_timer", minutes=minutes, label=label)
        wrong = [_call("set_timer", minutes=minutes + 5, label=label),
                 _call("set_timer", minutes=minutes, label=label2),
                 _call("set_timer", minutes=minutes * 60, label=label)]
    elif kind == 3:
        origin, dest, other = rng.sample(CITIES, 3)
        day = f"2027-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        request = f"Find me a flight from {origin} to {dest} on {day}."
        right = _call("search_flights", origin=origin, destination=dest, date=day)
        wrong = [_call("search_flights", origin=dest, destination=origin, date=day),
                 _call("search_flights", origin=origin, destination=other, date=day),
                 _call("get_weather", city=dest, unit="celsius")]
    else:
        to, to2 = rng.sample(PEOPLE, 2)
        subject, subject2 = rng.sample(SUBJECTS, 2)
        request = f"Email {to} with the subject \"{subject}\"."
        right = _call("send_email", to=to, subject=subject)
        wrong = [_call("send_email", to=to2, subject=subject), _call("send_email", to=to, subject=subject2),
                 _call("send_email", to=subject, subject=to)]
    values = [right] + wrong
    rng.shuffle(values)
    prompt = f"{TOOLS_TEXT}\nUser: {request}\nCall:"
    return {"id": f"toolcall-{i:03d}", "prompt": prompt, "choices": values, "label": values.index(right),
            "answer": right}


# ------------------------------------------------------------------------------------ writing

MAKERS = {"arith": _arith, "code": _code, "toolcall": _toolcall}


def items(kind: str) -> list[dict]:
    """The items of one kind; the same on every machine and every run (one seeded generator per kind)."""
    rng = random.Random(f"{SEED}-{kind}")
    out = [MAKERS[kind](rng, i) for i in range(COUNTS[kind])]
    for item in out:
        assert len(set(item["choices"])) == 4, item  # four distinct choices, one right
    return out


def jsonl_text(kind: str) -> str:
    return "".join(json.dumps(item, sort_keys=True) + "\n" for item in items(kind))


def write_taskset(folder: Path) -> list[Path]:
    """Write ``<kind>.jsonl`` for every kind into ``folder``; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in MAKERS:
        path = folder / f"{kind}.jsonl"
        path.write_text(jsonl_text(kind), encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_taskset(Path(__file__).resolve().parent / TASK_FOLDER):
        print(p)
