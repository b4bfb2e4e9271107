"""Run-directory metrics: one JSON object per step in metrics.jsonl, and
TensorBoard event files; only process 0 writes. `rollout_metrics` summarises
a step's rows (reward, length, truncation, staleness).

On resume, lines after the restored step are dropped first, so the file
never holds two versions of a step.
"""

import json
import math
import pathlib

import numpy as np


def _scalar(v):
    v = np.asarray(v)
    if v.size != 1:
        return None
    x = v.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no NaN; keep it visible, never drop it
    return x


class MetricsWriter:

    def __init__(self, workdir, *, enabled: bool = True, resume_step: int | None = None):
        self.enabled = enabled
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            keep = []
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if resume_step is not None and row.get("step", 0) <= resume_step:
                    keep.append(line)
            self.path.write_text("".join(l + "\n" for l in keep))
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tb"))

    def write(self, step: int, metrics: dict) -> dict:
        row = {"step": int(step)}
        for k, v in metrics.items():
            s = _scalar(v)
            if s is not None:
                row[k] = s
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        return row

    def close(self):
        if self._tb is not None:
            self._tb.close()


def read(workdir) -> list[dict]:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def rollout_metrics(rollout, source_names, version: int) -> dict:
    """Reward, pass rate, length, truncation and staleness of a rollout's active rows."""
    active = np.asarray(rollout.active_B)
    r = np.asarray(rollout.rewards_B)[active]
    if r.size == 0:
        return {"reward_mean": 0.0, "reward_std": 0.0, "pass_rate": 0.0, "response_len": 0.0}
    finite = r[np.isfinite(r)]
    per_source = {}
    if len(source_names) > 1:
        for si, name in enumerate(source_names):
            rs = np.asarray(rollout.rewards_B)[active & (np.asarray(rollout.source_B) == si)]
            rs = rs[np.isfinite(rs)]
            if rs.size:
                per_source[f"reward_mean/{name}"] = float(np.mean(rs))
    return per_source | {
        "reward_mean": float(np.mean(finite)) if finite.size else 0.0,
        "reward_std": float(np.std(finite)) if finite.size else 0.0,
        "pass_rate": float(np.mean(finite >= 1.0)) if finite.size else 0.0,
        "response_len": float(np.mean(rollout.completion_len_B[active])),
        "truncated_frac": float(np.mean(np.asarray(rollout.truncated_B)[active])),
        "staleness": float(np.mean(version - np.asarray(rollout.version_B))),
    }
