"""Every recipe on configs/toy.py, with the same seed and step budget.

Run: python experiments/recipes_toy.py [--steps 150] [--threshold 0.3]
         [--workdir runs/recipes_toy] [--recipes grpo,dapo] [--report]
(`--report` rebuilds the table and plot from the runs already in WORKDIR,
e.g. with another threshold, without training.)
(also `rljax sweep experiments/recipes_toy.py`, which writes the plain sweep
table without the steps-to-threshold column).

Prints, and writes to WORKDIR/recipes.md, a table of the final held-out reward
(greedy decoding on the toy's held-out strings), the final train reward and
the steps each recipe needed for its 10-step mean train reward to reach the
threshold; WORKDIR/results.png plots the curves. A recipe that fails keeps
its error in the table and the others still run. The toy task has dense
rewards (fraction of characters copied), so "reward" is not accuracy; the
train reward includes reward shaping where a recipe has it (DAPO's overlong
penalty), the held-out reward never does.
"""

import argparse
import pathlib
import sys

from rljax import recipes
from rljax import sweep as sweep_lib

SEED = 0
STEPS = 150
THRESHOLD = 0.3
WINDOW = 10


def get_sweep(steps: int = STEPS, names=None):
    """One point per recipe: the same toy config, seed and budget."""
    return {
        "name": "recipes_toy",
        "base": "configs/toy.py:grpo",
        "fixed": {"seed": SEED, "steps": steps},
        "overrides": [{"base": f"configs/toy.py:{name}"}
                      for name in (names or recipes.names())],
    }


COLUMNS = [("point", "recipe"), ("eval_reward", "held-out reward"),
           ("eval_accuracy", "held-out exact"), ("train_reward_last", "train reward (last 10)"),
           ("steps_to_threshold", "steps to threshold"), ("steps", "steps"),
           ("wall_s", "wall (s)"), ("error", "error")]


def recipes_table(rows: list[dict], threshold: float) -> list[dict]:
    """Adds `steps_to_threshold` to each sweep row (None: never reached)."""
    for r in rows:
        metrics = sweep_lib.read_metrics(r["run_dir"])
        r["steps_to_threshold"] = sweep_lib.steps_to_threshold(
            metrics, threshold, window=WINDOW) or f"> {r['steps']}"
    return rows


def read_rows(path) -> list[dict]:
    """The sweep rows of an earlier run (results.csv), numbers parsed back."""
    import csv
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("eval_reward", "eval_accuracy", "train_reward_last", "wall_s"):
            r[k] = float(r[k]) if r.get(k) else float("nan")
        r["steps"] = int(r["steps"] or 0)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--threshold", type=float, default=THRESHOLD)
    p.add_argument("--workdir", default="runs/recipes_toy")
    p.add_argument("--recipes", default="", help="comma-separated subset")
    p.add_argument("--report", action="store_true",
                   help="only rebuild the table from WORKDIR/results.csv")
    args = p.parse_args(argv)
    names = [n for n in args.recipes.split(",") if n] or None
    workdir = pathlib.Path(args.workdir)
    if args.report:
        rows = read_rows(workdir / "results.csv")
    else:
        rows = sweep_lib.run_sweep(get_sweep(args.steps, names), workdir)
    rows = recipes_table(rows, args.threshold)
    sweep_lib.write_csv(rows, workdir / "results.csv")
    sweep_lib.plot_results(rows, [r["run_dir"] for r in rows], workdir / "results.png",
                           title=f"every recipe on configs/toy.py, seed {SEED}",
                           window=WINDOW, threshold=args.threshold)
    command = "python experiments/recipes_toy.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    table = sweep_lib.markdown_table(rows, COLUMNS)
    text = (f"{table}\nSteps to threshold: first step whose {WINDOW}-step mean train "
            f"reward >= {args.threshold}. Command: `{command.strip()}`\n")
    (workdir / "recipes.md").write_text(text)
    print(text)
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
