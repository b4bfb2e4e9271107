"""Writes GSM8K-style word problems with exact integer answers, as JSON lines.

Run: python examples/gsm_synth/generate.py [--n 300] [--seed 0] [--out FILE]
Every problem comes from a template below (one to three arithmetic steps,
small numbers) filled in by a seeded generator, so the file is reproducible:
the same arguments write the same bytes. Each line has

  question:  the word problem;
  answer:    the final number, as text ("42");
  solution:  a worked solution whose last line is "#### 42" (GSM8K's form);
  steps:     how many arithmetic steps the solution takes (1 to 3).

The default output is examples/gsm_synth/train.jsonl, which the dataset
task and experiments/gsm_synth.py read.
"""

import argparse
import json
import pathlib
import random

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Iris",
         "Jack", "Kira", "Leo", "Maya", "Noah", "Olga", "Pablo", "Quinn",
         "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yara", "Zane"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "stamps",
         "shells", "cards", "books", "balloons", "oranges", "buttons"]
THINGS = [("notebook", "notebooks"), ("sandwich", "sandwiches"),
          ("ticket", "tickets"), ("toy car", "toy cars"), ("mug", "mugs"),
          ("plant", "plants"), ("kite", "kites"), ("scarf", "scarves")]


def _people(rng):
    return rng.sample(NAMES, 2)


def add(rng):
    name, _ = _people(rng)
    items = rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    return (f"{name} has {a} {items}. {name} buys {b} more {items}. How many "
            f"{items} does {name} have now?",
            [f"{name} has {a} + {b} = {a + b} {items}."], a + b)


def subtract(rng):
    name, friend = _people(rng)
    items = rng.choice(ITEMS)
    a = rng.randint(10, 60)
    b = rng.randint(1, a - 1)
    return (f"{name} had {a} {items} and gave {b} of them to {friend}. How many "
            f"{items} does {name} have left?",
            [f"{name} has {a} - {b} = {a - b} {items} left."], a - b)


def multiply(rng):
    items = rng.choice(ITEMS)
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    return (f"A box holds {a} {items}. How many {items} are in {b} boxes?",
            [f"{b} boxes hold {b} * {a} = {a * b} {items}."], a * b)


def share(rng):
    name, _ = _people(rng)
    items = rng.choice(ITEMS)
    each, friends = rng.randint(2, 12), rng.randint(2, 8)
    total = each * friends
    return (f"{name} shares {total} {items} equally among {friends} friends. "
            f"How many {items} does each friend get?",
            [f"Each friend gets {total} / {friends} = {each} {items}."], each)


def spend(rng):
    name, _ = _people(rng)
    one, many = rng.choice(THINGS)
    price, count = rng.randint(2, 15), rng.randint(2, 9)
    return (f"A {one} costs ${price}. {name} buys {count} {many}. How many "
            f"dollars does {name} spend?",
            [f"{name} spends {count} * {price} = {count * price} dollars."],
            count * price)


def packs_eaten(rng):
    name, _ = _people(rng)
    items = rng.choice(ITEMS)
    packs, per = rng.randint(2, 6), rng.randint(3, 10)
    eaten = rng.randint(1, packs * per - 1)
    total = packs * per
    return (f"{name} buys {packs} packs of {items} with {per} {items} in each "
            f"pack, then gives away {eaten} {items}. How many {items} does "
            f"{name} have left?",
            [f"{name} buys {packs} * {per} = {total} {items}.",
             f"{name} has {total} - {eaten} = {total - eaten} left."],
            total - eaten)


def change(rng):
    name, _ = _people(rng)
    one, many = rng.choice(THINGS)
    count, price = rng.randint(2, 6), rng.randint(2, 9)
    cost = count * price
    bill = next(b for b in (10, 20, 50, 100) if b > cost)
    return (f"{name} buys {count} {many} at ${price} each and pays with a "
            f"${bill} bill. How many dollars of change does {name} get?",
            [f"The {many} cost {count} * {price} = {cost} dollars.",
             f"The change is {bill} - {cost} = {bill - cost} dollars."],
            bill - cost)


def distance(rng):
    speed, hours = rng.randint(20, 70), rng.randint(2, 6)
    return (f"A train travels at {speed} miles per hour for {hours} hours. How "
            f"many miles does it travel?",
            [f"It travels {speed} * {hours} = {speed * hours} miles."],
            speed * hours)


def ages(rng):
    name, friend = _people(rng)
    age, gap, years = rng.randint(5, 30), rng.randint(2, 15), rng.randint(2, 10)
    now = age + gap
    return (f"{name} is {age} years old. {friend} is {gap} years older than "
            f"{name}. How old will {friend} be in {years} years?",
            [f"{friend} is {age} + {gap} = {now} years old now.",
             f"In {years} years {friend} will be {now} + {years} = "
             f"{now + years}."], now + years)


def savings(rng):
    name, _ = _people(rng)
    start, weekly, weeks = rng.randint(5, 50), rng.randint(2, 12), rng.randint(2, 8)
    saved = weekly * weeks
    return (f"{name} has ${start} and saves ${weekly} every week. How many "
            f"dollars will {name} have after {weeks} weeks?",
            [f"{name} saves {weekly} * {weeks} = {saved} dollars.",
             f"{name} will have {start} + {saved} = {start + saved} dollars."],
            start + saved)


def half_then_find(rng):
    name, friend = _people(rng)
    items = rng.choice(ITEMS)
    half, found = rng.randint(3, 25), rng.randint(2, 15)
    total = 2 * half
    return (f"{name} has {total} {items} and gives half of them to {friend}. "
            f"Then {name} finds {found} more {items}. How many {items} does "
            f"{name} have now?",
            [f"{name} keeps {total} / 2 = {half} {items}.",
             f"{name} then has {half} + {found} = {half + found} {items}."],
            half + found)


def pages_left(rng):
    name, _ = _people(rng)
    per_day, days = rng.randint(5, 20), rng.randint(2, 7)
    read = per_day * days
    pages = read + rng.randint(10, 120)
    return (f"A book has {pages} pages. {name} reads {per_day} pages a day for "
            f"{days} days. How many pages are left to read?",
            [f"{name} reads {per_day} * {days} = {read} pages.",
             f"{pages} - {read} = {pages - read} pages are left."], pages - read)


def present(rng):
    classes, size = rng.randint(2, 6), rng.randint(15, 30)
    total = classes * size
    absent = rng.randint(1, 12)
    return (f"A school has {classes} classes with {size} students in each "
            f"class. {absent} students are absent today. How many students "
            f"are present?",
            [f"There are {classes} * {size} = {total} students.",
             f"{total} - {absent} = {total - absent} are present."],
            total - absent)


def bake_sell(rng):
    name, _ = _people(rng)
    trays, per = rng.randint(2, 5), rng.randint(6, 12)
    total = trays * per
    sold = rng.randint(1, total // 2)
    given = rng.randint(1, total - sold - 1)
    left = total - sold - given
    return (f"{name} bakes {trays} trays of cookies with {per} cookies on each "
            f"tray. {name} sells {sold} cookies and gives {given} to the "
            f"neighbors. How many cookies are left?",
            [f"{name} bakes {trays} * {per} = {total} cookies.",
             f"After selling, {total} - {sold} = {total - sold} remain.",
             f"After giving some away, {total - sold} - {given} = {left} are "
             f"left."], left)


def fruit_stand(rng):
    name, _ = _people(rng)
    apples, price_a = rng.randint(2, 8), rng.randint(1, 4)
    pears, price_p = rng.randint(2, 8), rng.randint(1, 5)
    a_cost, p_cost = apples * price_a, pears * price_p
    return (f"{name} buys {apples} apples at ${price_a} each and {pears} pears "
            f"at ${price_p} each. How many dollars does {name} pay in total?",
            [f"The apples cost {apples} * {price_a} = {a_cost} dollars.",
             f"The pears cost {pears} * {price_p} = {p_cost} dollars.",
             f"The total is {a_cost} + {p_cost} = {a_cost + p_cost} dollars."],
            a_cost + p_cost)


TEMPLATES = [add, subtract, multiply, share, spend, distance, packs_eaten,
             change, ages, savings, half_then_find, pages_left, present,
             bake_sell, fruit_stand]


def generate(n: int, seed: int) -> list[dict]:
    """``n`` distinct problems; template ``i % len(TEMPLATES)`` for row ``i``."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        template = TEMPLATES[len(rows) % len(TEMPLATES)]
        question, steps, answer = template(rng)
        if question in seen:
            continue
        seen.add(question)
        assert isinstance(answer, int) and answer >= 0, (question, answer)
        rows.append({"question": question, "answer": str(answer),
                     "solution": "\n".join(steps) + f"\n#### {answer}",
                     "steps": len(steps)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(
        pathlib.Path(__file__).with_name("train.jsonl")))
    args = parser.parse_args()
    rows = generate(args.n, args.seed)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} problems to {args.out}")


if __name__ == "__main__":
    main()
