"""`rljax sweep SWEEP.py`: a base config plus a list (or product) of overrides.

A sweep file is Python with `get_sweep()` returning a dict:

    {"name": "dapo_eps_high",                 # default: the file's stem
     "base": "configs/toy.py:dapo",           # a config file[:argument]
     "overrides": [{"loss.eps_high": 0.2},    # one dict per point ...
                   {"loss.eps_high": 0.28}],
     # ... or a product: every combination, keys varying left to right slowest
     "product": {"loss.eps_high": [0.2, 0.28], "seed": [0, 1]},
     "fixed": {"steps": 100}}                 # optional, applied to every point

Keys are dotted config fields. The reserved key `base` inside a point (or a
product) swaps the base config for that point, so one sweep can compare
recipes (`{"base": "configs/toy.py:dapo"}`).

Every point is built and validated before the first one runs: an unknown key
or an impossible combination fails at once with the point and key named, not
an hour into the sweep. Each point trains in its own run directory under the
sweep directory (default `runs/sweeps/<name>`); a point whose directory holds
a finished run resumes from its checkpoint, so an interrupted sweep is rerun
with the same command. `--print` instead writes one `rljax train` command per
point, for a cluster scheduler.

Results: `results.csv` (every column), `results.md` (final held-out reward,
steps, wall time per point) and `results.png` (reward curves and the final
held-out reward) in the sweep directory.
"""

import csv
import dataclasses
import itertools
import json
import math
import pathlib
import re
import runpy
import shlex
import sys
import time
import traceback
from typing import Any, Optional

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
_SWEEP_KEYS = {"name", "base", "overrides", "product", "fixed"}

@dataclasses.dataclass
class Point:
    """One sweep point: its label, base config and overrides (dotted keys)."""

    index: int
    base: str
    overrides: dict
    label: str
    dirname: str


# ------------------------------------------------------------------ loading


def load_sweep(path) -> dict:
    """Runs a sweep file and returns its `get_sweep()` dict (name defaulted)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"sweep file {str(path)!r} does not exist")
    module = runpy.run_path(str(path))
    if "get_sweep" not in module:
        raise ValueError(f"sweep file {str(path)!r} defines no get_sweep()")
    sweep = dict(module["get_sweep"]())
    sweep.setdefault("name", path.stem)
    return sweep


def resolve_config_path(base: str) -> tuple[pathlib.Path, str]:
    """`configs/toy.py:dapo` -> (existing file, "dapo").

    A relative path is looked up from the working directory, then from the
    repository root, so `rljax sweep experiments/x.py` works from anywhere in
    a checkout.
    """
    file, _, arg = base.partition(":")
    path = pathlib.Path(file)
    if not path.is_absolute() and not path.exists():
        path = _REPO_ROOT / file
    if not path.is_file():
        raise ValueError(f"base config {file!r} not found (from {pathlib.Path.cwd()} "
                         f"or {_REPO_ROOT})")
    return path, arg


def load_base_config(base: str):
    """The locked config that `rljax train --config BASE` would start from."""
    path, arg = resolve_config_path(base)
    module = runpy.run_path(str(path))
    if "get_config" not in module:
        raise ValueError(f"base config {str(path)!r} defines no get_config()")
    return module["get_config"](arg) if arg else module["get_config"]()


# ------------------------------------------------------------------- points


def _fmt(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _base_label(base: str) -> str:
    """`configs/toy.py:dapo` -> `dapo`; `configs/toy.py` -> `toy`."""
    file, _, arg = base.partition(":")
    return arg or pathlib.Path(file).stem


def _label(overrides: dict) -> str:
    parts = []
    for k, v in overrides.items():
        parts.append(_base_label(v) if k == "base" else f"{k}={_fmt(v)}")
    return " ".join(parts) or "base"


def _dirname(index: int, label: str) -> str:
    # Run directories must be one path component a shell need not quote.
    safe = re.sub(r"[^A-Za-z0-9._=+-]+", "_", label).strip("_")
    return f"{index:02d}_{safe}"[:120]


def _check_structure(sweep: dict) -> None:
    unknown = set(sweep) - _SWEEP_KEYS
    if unknown:
        raise ValueError(f"unknown sweep fields {sorted(unknown)}; valid: "
                         f"{sorted(_SWEEP_KEYS)}")
    if not isinstance(sweep.get("base"), str) or not sweep["base"]:
        raise ValueError("a sweep needs 'base': a config file path such as "
                         "'configs/toy.py:dapo'")
    has_list, has_product = "overrides" in sweep, "product" in sweep
    if has_list == has_product:
        raise ValueError("a sweep needs exactly one of 'overrides' (a list of dicts) "
                         "or 'product' (a dict of key -> list of values)")
    if has_list:
        points = sweep["overrides"]
        if not isinstance(points, (list, tuple)) or not points:
            raise ValueError("sweep 'overrides' must be a non-empty list of dicts")
        for i, p in enumerate(points):
            if not isinstance(p, dict):
                raise ValueError(f"sweep point {i} is {type(p).__name__}, not a dict")
    else:
        product = sweep["product"]
        if not isinstance(product, dict) or not product:
            raise ValueError("sweep 'product' must be a non-empty dict of key -> list")
        for k, values in product.items():
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"sweep product key {k!r} needs a non-empty list of "
                                 f"values, got {values!r}")
    if not isinstance(sweep.get("fixed", {}), dict):
        raise ValueError("sweep 'fixed' must be a dict of overrides")


def expand(sweep: dict) -> list[Point]:
    """The sweep's points in run order (structure checked, configs not yet)."""
    _check_structure(sweep)
    if "overrides" in sweep:
        combos = [dict(p) for p in sweep["overrides"]]
    else:
        keys = list(sweep["product"])
        combos = [dict(zip(keys, values))
                  for values in itertools.product(*sweep["product"].values())]
    fixed = dict(sweep.get("fixed", {}))
    points = []
    for i, combo in enumerate(combos):
        # A point that names its base shows it; the sweep's own base goes unsaid.
        shown = dict(combo)
        base = combo.pop("base", sweep["base"])
        label = _label(shown)
        points.append(Point(i, base, fixed | combo, label, _dirname(i, label)))
    # Two identical points would only burn compute (and share nothing useful).
    keys = [(p.base, repr(sorted(p.overrides.items()))) for p in points]
    dup = sorted({p.label for p, k in zip(points, keys) if keys.count(k) > 1})
    if dup:
        raise ValueError(f"sweep points repeat: {dup}")
    return points


def point_config(point: Point, steps: Optional[int] = None):
    """The validated run config of one point; errors name the point and key."""
    from rljax import recipes
    from rljax.train import config as config_lib
    overrides = dict(point.overrides)
    if steps is not None:
        overrides["steps"] = steps
    try:
        config = load_base_config(point.base)
        recipes.apply_overrides(config, **overrides)
        return config_lib.validate(config)
    except ValueError as e:
        raise ValueError(f"sweep point {point.index} ({point.label}): {e}") from None


def train_command(point: Point, run_dir, steps: Optional[int] = None) -> str:
    """The `rljax train` line that runs `point` on its own (for a scheduler)."""
    path, arg = resolve_config_path(point.base)
    try:
        shown = path.relative_to(pathlib.Path.cwd())
    except ValueError:
        shown = path
    overrides = dict(point.overrides)
    if steps is not None:
        overrides["steps"] = steps
    args = ["rljax", "train", "--config", f"{shown}:{arg}" if arg else str(shown),
            "--workdir", str(run_dir)]
    args += [f"--config.{k}={_fmt(v)}" for k, v in overrides.items()]
    return " ".join(shlex.quote(a) for a in args)


# ------------------------------------------------------------------ results


def read_metrics(run_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl ([] when it has none yet)."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reward_curve(rows: list[dict], key: str = "reward_mean") -> tuple[list, list]:
    """(steps, values) of a per-step metric, skipping eval-only rows."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def smooth(values: list, window: int) -> list:
    """Trailing moving average (the first points average what exists)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def steps_to_threshold(rows: list[dict], threshold: float, *, key: str = "reward_mean",
                       window: int = 10) -> Optional[int]:
    """First step whose trailing `window`-step mean of `key` reaches `threshold`.

    Smoothed because a single lucky batch of 64 samples is not "learned".
    None when the run never gets there.
    """
    steps, values = reward_curve(rows, key)
    for s, v in zip(steps, smooth(values, window)):
        if v >= threshold:
            return s
    return None


def summarize(rows: list[dict], *, window: int = 10) -> dict:
    """Final and initial held-out reward, steps, last-window train reward."""
    evals = [r for r in rows if "eval_reward" in r]
    steps, rewards = reward_curve(rows)
    tail = rewards[-window:]
    return {
        "steps": steps[-1] if steps else 0,
        "eval_reward_before": evals[0]["eval_reward"] if evals else math.nan,
        "eval_reward": evals[-1]["eval_reward"] if evals else math.nan,
        "eval_accuracy": evals[-1].get("eval_accuracy", math.nan) if evals else math.nan,
        "train_reward_last": sum(tail) / len(tail) if tail else math.nan,
    }


CSV_FIELDS = ["point", "run_dir", "steps", "eval_reward", "eval_accuracy",
              "eval_reward_before", "train_reward_last", "wall_s", "train_wall_s",
              "error"]


def write_csv(rows: list[dict], path, fields=CSV_FIELDS) -> None:
    extra = [k for r in rows for k in r if k not in fields]
    fields = list(fields) + list(dict.fromkeys(extra))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in fields})


def _cell(v: Any) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A GitHub table of `rows`; `columns` are (key, header) pairs."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k)).replace("|", "/")
                                       for k, _ in columns) + " |")
    return "\n".join(lines) + "\n"


MD_COLUMNS = [("point", "point"), ("eval_reward", "held-out reward"),
              ("eval_accuracy", "held-out accuracy"), ("steps", "steps"),
              ("wall_s", "wall time (s)"), ("error", "error")]


def plot_results(rows: list[dict], run_dirs: list, out, *, title: str = "",
                 window: int = 10, threshold: Optional[float] = None) -> str:
    """Smoothed train reward per point, and the final held-out reward as bars."""
    # A bare Figure renders with Agg and leaves pyplot's backend alone, so a
    # notebook that calls this keeps its inline figures.
    from matplotlib.figure import Figure
    fig = Figure(figsize=(13, 4.8))
    ax_c, ax_b = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    for r, run_dir in zip(rows, run_dirs):
        steps, values = reward_curve(read_metrics(run_dir))
        if steps:
            ax_c.plot(steps, smooth(values, window), label=r["point"])
    if threshold is not None:
        ax_c.axhline(threshold, color="gray", ls="--", lw=1, label=f"threshold {threshold}")
    ax_c.set_xlabel("step")
    ax_c.set_ylabel(f"train reward ({window}-step mean)")
    ax_c.grid(alpha=0.3)
    ax_c.legend(fontsize=8)
    finals = [r.get("eval_reward", math.nan) for r in rows]
    ax_b.barh(range(len(rows)), [0.0 if math.isnan(f) else f for f in finals])
    ax_b.set_yticks(range(len(rows)), [r["point"] for r in rows], fontsize=8)
    ax_b.invert_yaxis()
    ax_b.set_xlabel("final held-out reward")
    ax_b.grid(alpha=0.3, axis="x")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    return str(out)


def write_results(rows: list[dict], workdir, *, title: str = "") -> dict:
    """results.csv, results.md and results.png in `workdir`; returns the paths."""
    workdir = pathlib.Path(workdir)
    paths = {"csv": workdir / "results.csv", "md": workdir / "results.md",
             "png": workdir / "results.png"}
    write_csv(rows, paths["csv"])
    paths["md"].write_text(markdown_table(rows, MD_COLUMNS))
    plot_results(rows, [r["run_dir"] for r in rows], paths["png"], title=title)
    return paths


# ---------------------------------------------------------------------- run


def _run_point(config, run_dir: pathlib.Path) -> dict:
    """Trains one point in-process; a failure becomes the row's `error`."""
    from rljax.train import loop
    t0 = time.perf_counter()
    try:
        summary = loop.train(config, run_dir)
        error = ""
    except Exception as e:  # one broken point must not lose the others
        summary = {}
        error = f"{type(e).__name__}: {e}"
        (run_dir / "error.txt").write_text(traceback.format_exc())
    return {"wall_s": time.perf_counter() - t0,
            "train_wall_s": summary.get("train_wall_s", math.nan), "error": error}


def run_sweep(sweep: dict, workdir=None, *, print_only: bool = False,
              steps: Optional[int] = None, out=None) -> list[dict]:
    """Validates every point, then runs them one after another (or prints them).

    Returns one result row per point (see CSV_FIELDS); with `print_only`, one
    row per point with its `command` and nothing is trained or written.
    `steps` overrides every point's `steps`.
    """
    out = out or sys.stdout
    points = expand(sweep)
    configs = [point_config(p, steps) for p in points]  # fail before any run
    workdir = pathlib.Path(workdir or pathlib.Path("runs/sweeps") / sweep["name"])
    if print_only:
        rows = []
        for p in points:
            cmd = train_command(p, workdir / p.dirname, steps)
            print(cmd, file=out)
            rows.append({"point": p.label, "run_dir": str(workdir / p.dirname),
                         "command": cmd})
        return rows
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "sweep.json").write_text(json.dumps(
        {"name": sweep["name"], "base": sweep["base"], "steps": steps,
         "points": [dataclasses.asdict(p) for p in points]}, indent=2, default=repr))
    rows = []
    for p, config in zip(points, configs):
        run_dir = workdir / p.dirname
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"[{p.index + 1}/{len(points)}] {p.label} -> {run_dir}", file=out, flush=True)
        timing = _run_point(config, run_dir)
        row = {"point": p.label, "run_dir": str(run_dir),
               **summarize(read_metrics(run_dir)), **timing}
        if row["error"]:
            print(f"  failed: {row['error']}", file=out, flush=True)
        rows.append(row)
        # Rewritten after every point: a killed sweep still has its table.
        write_results(rows, workdir, title=sweep["name"])
    return rows
