"""The thin loop: collect -> streams -> epochs x minibatches of steps -> sync weights.

Everything numeric lives in pure functions (rljax.objective and the axes,
the jitted step in rljax.train.step); `build` makes a run's parts once and
`collect` its rollouts. A `Trainer` holds only the run's state between steps
(train state, data position, policy version, skip counters), threads it
through those functions, and writes metrics and checkpoints. A run killed at
any point resumes from its last checkpoint and, in synchronous mode,
continues the same trajectory (sampling seeds derive from the step; the data
position is checkpointed).
"""

import logging
import queue
import threading
import time

import jax
import numpy as np

from rljax import objective
from rljax.train import build as build_lib
from rljax.train import checkpoint as ckpt_lib
from rljax.train import collect as collect_lib
from rljax.train import eval as eval_lib
from rljax.train import metrics as metrics_lib

log = logging.getLogger("rljax.train")


def minibatch_rows(num_groups: int, group_size: int, *, epochs: int, minibatches: int,
                   rng: np.random.Generator):
    """Row indices of each optimizer step: `epochs` passes over shuffled whole groups."""
    for _ in range(epochs):
        order = rng.permutation(num_groups) if minibatches > 1 else np.arange(num_groups)
        for chunk in np.array_split(order, minibatches):
            yield (chunk[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)


def sampling_seed(config, step: int) -> int:
    return config.seed * 100003 + step


class Trainer:
    """A run's state between steps; `train()` trains `config.steps` steps."""

    def __init__(self, run: build_lib.Run, state):
        self.run, self.state = run, state
        c = run.config
        self.is_main = jax.process_index() == 0
        self.checkpointer = ckpt_lib.Checkpointer(run.workdir / "checkpoints",
                                                  keep=c.train.keep_checkpoints)
        self.data_pos = {s.name: 0 for s in run.sources}
        self.version = 0
        self.consecutive_skips = 0
        self.total_skips = 0
        self.start_step = 0
        self._restore()
        self.writer = metrics_lib.MetricsWriter(
            run.workdir, enabled=self.is_main,
            resume_step=self.start_step if self.start_step else -1)

    @classmethod
    def create(cls, config, workdir, *, sampler=None) -> "Trainer":
        """Builds the run for `config` in `workdir` and resumes its latest checkpoint."""
        return cls(*build_lib.build(config, workdir, sampler=sampler))

    # ------------------------------------------------------------ state

    def _restore(self):
        got = self.checkpointer.restore(ckpt_lib.abstract(self.state))
        if got is None:
            return
        step, self.state, meta = got
        self.start_step = step
        self.data_pos = {k: int(v) for k, v in meta["data_pos"].items()}
        self.version = int(meta["version"])
        self.consecutive_skips = int(meta.get("consecutive_skips", 0))
        self.total_skips = int(meta.get("total_skips", 0))
        self.run.sampler.update_weights(self.state.params, self.version)
        log.info("resumed from step %d (data positions %s)", step, self.data_pos)

    def save(self, step: int, wait: bool = False):
        meta = {"data_pos": self.data_pos, "version": self.version,
                "consecutive_skips": self.consecutive_skips,
                "total_skips": self.total_skips, "step": step}
        self.checkpointer.save(step, self.state, meta, wait=wait)

    def close(self):
        self.checkpointer.close()
        self.writer.close()

    # ------------------------------------------------------------ steps

    def collect(self, data_pos, seed: int):
        """One step's rollout at the sampler's current weights."""
        return collect_lib.collect(self.run, data_pos, seed=seed, version=self.version)

    def evaluate(self) -> dict:
        return eval_lib.evaluate(self.run, self.version)

    def train_on(self, rollout, step: int) -> dict:
        """All optimizer steps of one rollout (epochs x minibatches)."""
        run, c = self.run, self.run.config
        streams = objective.token_streams(run.objective, rollout,
                                          run.logprobs(self.state, rollout),
                                          version=self.version)
        outs = []
        for rows in minibatch_rows(
                rollout.shape[0] // c.group_size, c.group_size, epochs=c.offpolicy.epochs,
                minibatches=c.offpolicy.minibatches, rng=np.random.default_rng([c.seed, step])):
            self.state, m = run.programs.train_step(
                self.state, objective.train_batch(run.objective, streams, rows))
            outs.append(m)
        host = jax.device_get(outs)
        metrics = {k: float(np.mean([o[k] for o in host])) for k in host[0]}
        metrics["skipped"] = int(sum(int(o["skipped"]) for o in host))
        metrics.update({k: v if isinstance(v, int) else float(v)
                        for k, v in streams.metrics.items()})
        return metrics

    def _rollouts(self):
        """Yields rollouts: in line (sync) or from a thread running ahead (async)."""
        c = self.run.config
        if c.sampler.ahead <= 0:
            for step in range(self.start_step, c.steps):
                yield self.collect(self.data_pos, sampling_seed(c, step))
            return
        q: queue.Queue = queue.Queue(maxsize=c.sampler.ahead)
        stop = threading.Event()

        def produce():
            pos = self.data_pos
            for step in range(self.start_step, c.steps):
                if stop.is_set():
                    return
                try:
                    rollout = self.collect(pos, sampling_seed(c, step))
                except Exception as e:  # surfaced in the training thread
                    q.put(e)
                    return
                pos = rollout.data_pos
                while not stop.is_set():
                    try:
                        q.put(rollout, timeout=0.5)
                        break
                    except queue.Full:
                        continue

        thread = threading.Thread(target=produce, daemon=True, name="rljax-sampler")
        thread.start()
        try:
            for _ in range(self.start_step, c.steps):
                item = q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=60)

    def train(self) -> dict:
        from tqdm import tqdm
        c = self.run.config
        summary = {"start_step": self.start_step}
        if self.start_step == 0:
            summary["eval_before"] = self.evaluate()
            self.writer.write(0, summary["eval_before"])
        bar = tqdm(total=c.steps, initial=self.start_step, disable=not self.is_main,
                   desc="train", dynamic_ncols=True)
        t_run = time.perf_counter()
        for step, rollout in enumerate(self._rollouts(), start=self.start_step):
            t0 = time.perf_counter()
            m = self.train_on(rollout, step)
            t_train = time.perf_counter() - t0
            m.update(metrics_lib.rollout_metrics(
                rollout, [s.name for s in self.run.sources], self.version))
            self.data_pos = rollout.data_pos
            self.version += 1
            self.run.sampler.update_weights(self.state.params, self.version)
            if m["skipped"]:
                self.consecutive_skips += 1
                self.total_skips += m["skipped"]
                log.warning("step %d: non-finite loss or gradient, update skipped "
                            "(%d in a row)", step, self.consecutive_skips)
            else:
                self.consecutive_skips = 0
            m.update(rollout.stats)
            m["time_train"] = t_train
            m["step_time"] = t_train + rollout.stats["time_sample"] + rollout.stats["time_score"]
            m["tokens_per_s"] = float(rollout.loss_mask_BxT.sum()) / max(m["step_time"], 1e-9)
            m["total_skips"] = self.total_skips
            if c.train.eval_every and (step + 1) % c.train.eval_every == 0 and step + 1 < c.steps:
                m.update(self.evaluate())
            self.writer.write(step + 1, m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", step_s=f"{m['step_time']:.1f}")
            if self.consecutive_skips > c.train.max_consecutive_skips:
                self.save(step + 1, wait=True)
                raise RuntimeError(
                    f"{self.consecutive_skips} consecutive steps had a non-finite loss or "
                    f"gradient (train.max_consecutive_skips={c.train.max_consecutive_skips}); "
                    f"state saved at step {step + 1}, last good parameters kept")
            if (step + 1) % c.train.checkpoint_every == 0 or step + 1 == c.steps:
                self.save(step + 1)
        bar.close()
        summary["train_wall_s"] = time.perf_counter() - t_run
        summary["eval_after"] = self.evaluate()
        self.writer.write(c.steps, summary["eval_after"])
        self.close()
        return summary


def train(config, workdir, *, sampler=None) -> dict:
    """Trains `config` in `workdir` (resuming from its latest checkpoint)."""
    return Trainer.create(config, workdir, sampler=sampler).train()


def evaluate_run(config, workdir) -> dict:
    """Held-out accuracy of the latest checkpoint in `workdir`."""
    trainer = Trainer.create(config, workdir)
    if trainer.start_step == 0:
        trainer.close()
        raise ValueError(f"{workdir} has no checkpoint to evaluate")
    out = {"step": trainer.start_step, **trainer.evaluate()}
    trainer.close()
    return out
