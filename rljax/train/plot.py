"""`rljax plot RUN_DIR`: the run's curves as one PNG (matplotlib, no display)."""

import pathlib

from rljax.train import metrics as metrics_lib

PANELS = [
    ("reward_mean", "reward"),
    ("response_len", "response length"),
    ("kl", "KL to reference"),
    ("clip_frac", "clipped fraction"),
    ("mismatch_abs", "trainer-sampler |logp - mu|"),
    ("eval_reward", "held-out reward"),
]


def plot_run(run_dir, out=None) -> str:
    # A bare Figure: no pyplot backend switch, so a notebook's figures survive.
    from matplotlib.figure import Figure
    rows = metrics_lib.read(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rows")
    fig = Figure(figsize=(13, 7))
    axes = fig.subplots(2, 3)
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(r["step"], r[key]) for r in rows
               if isinstance(r.get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 5 else None)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(pathlib.Path(run_dir).name))
    fig.tight_layout()
    out = str(out or pathlib.Path(run_dir) / "curves.png")
    fig.savefig(out, dpi=90)
    return out
