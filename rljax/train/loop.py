"""The thin loop: sample -> score -> advantages -> train -> sync weights.

Everything numeric lives in pure functions (rljax.objective, the axes, the
jitted step in rljax.train.step); this file only threads state and data
between them, writes metrics and checkpoints, and keeps the run resumable:
a run killed at any point resumes from its last checkpoint and, in
synchronous mode, continues the same trajectory (sampling seeds derive from
the step, the data position and RNG are checkpointed).
"""

import dataclasses
import logging
import pathlib
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import normalizers
from rljax import objective
from rljax import offpolicy
from rljax import parallel
from rljax import shaping
from rljax.batch import TrainBatch
from rljax.train import checkpoint as ckpt_lib
from rljax.train import metrics as metrics_lib
from rljax.train import rollout as rollout_lib
from rljax.train import step as step_lib

log = logging.getLogger("rljax.train")


def _with_lr(optim, lr):
    out = optim.copy_and_resolve_references()
    with out.unlocked():
        out.lr = lr
    return out


def build_task(config, name=None, args=None, reward_fn=None):
    """A task from the config (or from a source's name/args/reward_fn)."""
    from rljax import tasks
    kwargs = dict((config.task.args if args is None else args).to_dict())
    reward_fn = config.task.reward_fn if reward_fn is None else reward_fn
    if reward_fn:
        kwargs["reward_fn"] = reward_fn
    return tasks.get_task(name or config.task.name, seed=config.seed, **kwargs)


@dataclasses.dataclass
class Source:
    """One task source of the batch and how its rows train (SPEC.md's table)."""

    name: str
    task: object
    algorithm: str | None   # None: the recipe's own estimator (single source)
    weight: float = 1.0
    ce_weight: float = 1.0
    teacher: str = ""


KIND_RL, KIND_SFT, KIND_OPD = 0, 1, 2


def allocate(weights, total: int) -> list[int]:
    """Largest-remainder split of `total` groups by `weights` (sums to total)."""
    w = np.asarray(weights, float) / np.sum(weights)
    raw = w * total
    out = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - out))[:total - out.sum()]:
        out[i] += 1
    return out.tolist()


def build_policy(config, task, mesh=None, rules=parallel.DEFAULT_RULES):
    """(model, tokenizer): pretrained weights, or a preset initialised from the seed.

    A preset (e.g. `tiny`) trains from scratch with the task's own character
    tokenizer (toy tasks ship one), sized to its vocabulary. With a `mesh`, a
    preset is initialised already sharded (parallel.init_sharded).
    """
    from rljax.models import config as model_config
    from rljax.models import loading
    from rljax.models import transformer
    m = config.model
    dtypes = dict(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat)
    if m.source in model_config.preset_names():
        if not hasattr(task, "tokenizer"):
            raise ValueError(f"model.source={m.source!r} is a random-init preset; it needs a "
                             f"task with its own tokenizer (toy tasks), not {config.task.name!r}")
        tok = task.tokenizer()
        cfg = model_config.get_preset(m.source, vocab_size=tok.vocab_size, **dtypes)
        make = lambda: transformer.Decoder(cfg, rngs=nnx.Rngs(config.seed))  # noqa: E731
        if mesh is None:
            return make(), tok
        return nnx.merge(*parallel.init_sharded(make, mesh, rules)), tok
    return loading.load_pretrained(m.source, param_dtype=m.param_dtype,
                                   compute_dtype=m.compute_dtype, remat=m.remat)


def build_sampler(config, model, rules=parallel.DEFAULT_RULES, sync_dir=None):
    """In-process sampler, or a client of `rljax serve` / vLLM at sampler.url.

    Remote weights travel as orbax checkpoints in `sampler.sync_dir` (default
    `<workdir>/sampler_sync`), a directory the server must be able to read.
    """
    from rljax import sampling
    if config.sampler.kind == "remote":
        return sampling.RemoteSampler(config.sampler.url,
                                      sync_dir=config.sampler.sync_dir or sync_dir)
    if jax.device_count() == 1:
        return sampling.InProcessSampler(model)
    # Its own (data, tensor) mesh over this process's devices; weights are
    # gathered and resharded onto it at every sync.
    mesh = parallel.make_sampler_mesh(config.mesh.sampler_tensor)
    return sampling.InProcessSampler(model, mesh=mesh, rules=rules)


@dataclasses.dataclass
class Rollout:
    """One step's sampled groups, scored, with the data position after them."""

    arrays: rollout_lib.RolloutArrays
    rewards: np.ndarray        # float32 [B]
    active: np.ndarray         # bool [B]: False for filler groups (dynamic sampling)
    data_pos: dict             # source name -> next example index
    texts: list
    stats: dict
    kind: np.ndarray = None    # int [B]: KIND_RL | KIND_SFT | KIND_OPD
    source: np.ndarray = None  # int [B]: index into Trainer.sources
    episode: np.ndarray = None  # int [B]: the group row each row belongs to (-1 filler)
    primary: int = 0           # rows before the multi-turn overflow rows


class _Locked:
    """A sampler whose generate calls hold the trainer's lock (async mode)."""

    def __init__(self, sampler, lock):
        self.sampler, self.lock = sampler, lock

    def generate(self, prompts, params):
        with self.lock:
            return self.sampler.generate(prompts, params)


class Trainer:
    """Holds the run's objects; `run()` trains `config.steps` steps."""

    def __init__(self, config, workdir, *, sampler=None):
        self.config = config
        parallel.initialize(config)  # multi-host: before anything touches a device
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.is_main = jax.process_index() == 0
        if self.is_main:
            (self.workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
        self.mesh = parallel.make_mesh(config.mesh)
        self.rules = parallel.rules_from_config(config)
        log.info("mesh %s", parallel.describe(self.mesh))
        self.task = build_task(config)
        self.sources = self._build_sources()
        model, self.tokenizer = build_policy(config, self.sources[0].task, self.mesh, self.rules)
        self.graphdef, params = nnx.split(model)
        params = parallel.shard_params(params, self.mesh, self.rules)  # loaded weights
        self.optimizer = step_lib.make_optimizer(config.optim, config.steps)
        critic_params = critic_opt = self.critic_graphdef = self.value_fn = None
        if config.advantage.estimator == "gae":
            from rljax.models import ValueModel
            critic = (ValueModel.from_policy(model) if config.critic.init == "policy"
                      else ValueModel(model.config, rngs=nnx.Rngs(config.seed + 1)))
            self.critic_graphdef, critic_params = nnx.split(critic)
            critic_params = parallel.shard_params(critic_params, self.mesh, self.rules)
            critic_opt = step_lib.make_optimizer(_with_lr(config.optim, config.critic.lr),
                                                 config.steps)
            self.value_fn = step_lib.make_value_fn(self.critic_graphdef)
        # eval_shape -> shardings -> jit(init, out_shardings): moments sharded like params.
        self.state, self.state_sharding = parallel.init_state_sharded(
            lambda p, cp: step_lib.init_state(p, self.optimizer, config.seed, cp, critic_opt),
            self.mesh, self.rules, params, critic_params)
        # Batches arrive as host data; each process feeds the rows its devices hold.
        self.batch_sharding = parallel.batch_sharding(self.mesh, self.rules)
        if self.value_fn is not None:
            self.value_fn = parallel.ShardedFn(self.value_fn, self.batch_sharding, feed=(1, 2),
                                               local_outputs=True)
        # The reference policy is the initial one, frozen.
        self.ref_params = jax.tree.map(jnp.copy, params) if self._needs_ref() else None
        self.sampler = sampler if sampler is not None else build_sampler(
            config, model, self.rules, sync_dir=str(self.workdir / "sampler_sync"))
        self.train_step = parallel.ShardedFn(step_lib.make_train_step(
            config, self.graphdef, self.optimizer,
            micro_batches=config.train.micro_batches, chunk_size=config.model.chunk_size,
            critic_graphdef=self.critic_graphdef, critic_optimizer=critic_opt,
            state_sharding=self.state_sharding, batch_sharding=self.batch_sharding),
            self.batch_sharding, feed=(1,))
        self.logprob_fn = parallel.ShardedFn(step_lib.make_logprob_fn(
            self.graphdef, temperature=config.rollout.temperature,
            chunk_size=config.model.chunk_size), self.batch_sharding, feed=(1, 2),
            local_outputs=True)
        self.stop_ids = tuple(i for i in [self.tokenizer.eos_token_id] if i is not None)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id or 0
        self.checkpointer = ckpt_lib.Checkpointer(self.workdir / "checkpoints",
                                                  keep=config.train.keep_checkpoints)
        self.teachers = {s.name: self._build_teacher(s) for s in self.sources
                         if s.algorithm == "opd"}
        self.data_pos = {s.name: 0 for s in self.sources}
        self.version = 0
        self.consecutive_skips = 0
        self.total_skips = 0
        self.start_step = 0
        self._restore()
        self.writer = metrics_lib.MetricsWriter(
            self.workdir, enabled=self.is_main,
            resume_step=self.start_step if self.start_step else -1)
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- setup

    def _needs_ref(self) -> bool:
        return self.config.kl.placement != "none"

    def _build_sources(self) -> list:
        c = self.config
        if not len(c.sources):
            return [Source("main", self.task, None)]
        return [Source(name, build_task(c, s.task, s.args, s.reward_fn), s.algorithm,
                       s.weight, s.ce_weight, s.teacher)
                for name, s in sorted(c.sources.items())]

    def _build_teacher(self, src: Source):
        """(graphdef, params) of an opd teacher: a run directory or a pretrained source."""
        path = pathlib.Path(src.teacher)
        if (path / "checkpoints").is_dir():
            got = ckpt_lib.Checkpointer(path / "checkpoints").restore(
                ckpt_lib.abstract(self.state))
            if got is None:
                raise ValueError(f"sources.{src.name}.teacher={src.teacher!r} has no checkpoint")
            return self.logprob_fn, got[1].params
        from rljax.models import loading
        teacher = loading.load_model(src.teacher)
        if teacher.config.vocab_size != self.tokenizer.vocab_size:
            raise ValueError(
                f"sources.{src.name}.teacher={src.teacher!r} has a vocabulary of "
                f"{teacher.config.vocab_size}, the policy's tokenizer {self.tokenizer.vocab_size}")
        graphdef, params = nnx.split(teacher)
        fn = step_lib.make_logprob_fn(graphdef, temperature=self.config.rollout.temperature,
                                      chunk_size=self.config.model.chunk_size)
        fn = parallel.ShardedFn(fn, self.batch_sharding, feed=(1, 2), local_outputs=True)
        return fn, parallel.shard_params(params, self.mesh, self.rules)

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
        self.sampler.update_weights(self.state.params, self.version)
        log.info("resumed from step %d (data positions %s)", step, self.data_pos)

    def _save(self, step: int, wait: bool = False):
        meta = {"data_pos": self.data_pos, "version": self.version,
                "consecutive_skips": self.consecutive_skips,
                "total_skips": self.total_skips, "step": step}
        self.checkpointer.save(step, self.state, meta, wait=wait)

    # ------------------------------------------------------------- sampling

    def render(self, example, task=None) -> list[int]:
        return self._render_messages((task or self.task).messages(example))

    def _render_messages(self, messages) -> list[int]:
        if self.config.task.system_prompt:
            messages = [{"role": "system", "content": self.config.task.system_prompt}] + [
                m for m in messages if m["role"] != "system"]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def _decode(self, ids) -> str:
        """The completion's text for the reward: only the final stop token is cut.

        Other special tokens stay in the text (skip_special_tokens=False): a
        policy that pads its answer with <pad>/<bos> must not get them for
        free. Ids outside the vocabulary come only from a broken sampler; the
        row is dropped later (bad_rows), the text just must not crash scoring.
        """
        ids = list(ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        v = self.tokenizer.vocab_size
        return self.tokenizer.decode([i for i in ids if 0 <= i < v],
                                     skip_special_tokens=False)

    def _sampling_params(self, seed: int, n: int):
        from rljax.sampling import SamplingParams
        r = self.config.rollout
        return SamplingParams(max_new_tokens=self.config.max_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k, stop_token_ids=self.stop_ids,
                              n=n, seed=seed)

    def _next_examples(self, src: Source, pos: int, count: int, stats: dict):
        """`count` examples of `src` from data position `pos` (long prompts skipped)."""
        examples, prompts = [], []
        while len(examples) < count:
            ex = src.task.train_example(pos)
            pos += 1
            ids = self.render(ex, src.task)
            if len(ids) > self.config.rollout.max_prompt_tokens:
                stats["skipped_prompts"] += 1
                continue
            examples.append(ex)
            prompts.append(ids)
        return examples, prompts, pos

    def _score(self, src: Source, ex, group):
        c = self.config
        texts = [self._decode(cc.completion_ids) for cc in group]
        rewards = np.array([src.task.reward(t, ex) for t in texts], np.float32)
        if c.dapo.overlong:
            lens = np.array([len(cc.completion_ids) for cc in group])
            rewards = rewards + np.asarray(shaping.overlong_penalty(
                lens, max_tokens=c.max_tokens, buffer=c.dapo.overlong_buffer,
                factor=c.dapo.overlong_factor))
        return rewards, texts

    def _sample_round(self, src: Source, examples, prompts, seed: int, stats):
        """[(rows, rewards, texts, overflow_rows)] per example: single- or multi-turn."""
        n = self.config.group_size
        if not self.config.env.name:
            with self._lock:
                comps = self.sampler.generate(prompts, self._sampling_params(seed, n))
            out = []
            ts = time.perf_counter()
            for gi, ex in enumerate(examples):
                group = comps[gi * n:(gi + 1) * n]
                rewards, texts = self._score(src, ex, group)
                out.append(([rollout_lib.Row.from_completion(cc) for cc in group],
                            rewards, texts, []))
            stats["time_score"] += time.perf_counter() - ts
            return out
        episodes, ep_stats = self._episodes(src, examples, n, seed)
        for k, v in ep_stats.items():
            stats[k] = stats.get(k, 0) + v
        stats.setdefault("_episodes", []).extend(episodes)
        out = []
        for gi in range(len(examples)):
            eps = episodes[gi * n:(gi + 1) * n]
            rewards = np.array([e.reward for e in eps], np.float32)
            rows, overflow = [], []
            for j, e in enumerate(eps):
                # The last row is the group's row; rows closed by a prefix break
                # train too, with the episode's advantage.
                rows.append(e.row)
                overflow += [(j, r) for r in e.closed_rows]
            texts = [self._decode([t for t, m in zip(e.row.tokens, e.row.sampled) if m])
                     for e in eps]
            out.append((rows, rewards, texts, overflow))
        return out

    def _episodes(self, src: Source, examples, n, seed, greedy=False):
        from rljax import envs
        from rljax.train import multiturn
        c = self.config

        def params(turn):
            base = self._sampling_params(seed * 131 + turn, 1)
            return base.replace(temperature=0.0) if greedy else base

        return multiturn.run_episodes(
            examples=examples, n=n,
            make_env=lambda: envs.get_env(c.env.name, src.task, max_turns=c.env.max_turns,
                                          over_budget_reward=c.env.over_budget_reward,
                                          **c.env.args.to_dict()),
            render_messages=self._render_messages, sampler=_Locked(self.sampler, self._lock),
            sampling_params=params, decode=self._decode, token_budget=c.env.token_budget,
            max_row_tokens=c.env.max_row_tokens, version=self.version)

    def _sampled_groups(self, src: Source, g_target: int, pos: int, seed: int, stats):
        """`g_target` scored groups of `src` (DAPO: informative ones, bounded rounds)."""
        c = self.config
        # Dynamic sampling filters outcome groups; distillation has no reward signal to filter.
        dynamic = c.dapo.dynamic_sampling and src.algorithm != "opd"
        kept, filler, rounds = [], [], 0
        while True:
            rounds += 1
            examples, prompts, pos = self._next_examples(src, pos, g_target, stats)
            for item in self._sample_round(src, examples, prompts, seed * 1009 + rounds, stats):
                rewards = item[1]
                informative = bool(np.all(np.isfinite(rewards)) and np.ptp(rewards) > 0)
                if dynamic and not informative:
                    stats["filtered_groups"] += 1
                    filler.append(item)
                else:
                    kept.append(item)
            if not dynamic or len(kept) >= g_target or rounds >= c.dapo.max_sampling_rounds:
                break
        stats["sampling_rounds"] = max(stats["sampling_rounds"], rounds)
        kept = kept[:g_target]
        short = g_target - len(kept)
        stats["dynamic_sampling_shortfall"] += short
        active = [True] * len(kept) + [False] * short
        return kept + filler[:short], active, pos

    def _sft_groups(self, src: Source, g_target: int, pos: int, stats):
        """Rows of (prompt, reference answer + EOS): no sampling, `ce` targets."""
        from rljax.sampling import Completion
        n = self.config.group_size
        examples, prompts, pos = self._next_examples(src, pos, g_target * n, stats)
        groups = []
        for gi in range(g_target):
            group, texts = [], []
            for ex, ids in zip(examples[gi * n:(gi + 1) * n], prompts[gi * n:(gi + 1) * n]):
                target = self.tokenizer.encode(str(ex.answer))[:self.config.max_tokens - 1]
                target = target + list(self.stop_ids[:1])
                group.append(Completion(prompt_ids=ids, completion_ids=target,
                                        logprobs=[0.0] * len(target), finish_reason="stop",
                                        version=self.version))
                texts.append(str(ex.answer))
            rewards = np.array([src.task.reward(t, ex) for t, ex in
                                zip(texts, examples[gi * n:(gi + 1) * n])], np.float32)
            groups.append(([rollout_lib.Row.from_completion(cc) for cc in group],
                           rewards, texts, []))
        return groups, [True] * g_target, pos

    def collect(self, data_pos: dict, seed: int) -> Rollout:
        """Samples and scores `prompts_per_step` groups, split over the sources."""
        c = self.config
        n = c.group_size
        stats = {"skipped_prompts": 0, "filtered_groups": 0, "sampling_rounds": 0,
                 "dynamic_sampling_shortfall": 0, "time_score": 0.0}
        t0 = time.perf_counter()
        if isinstance(data_pos, int):
            data_pos = {src.name: data_pos for src in self.sources}
        data_pos = dict(data_pos)
        counts = allocate([s.weight for s in self.sources], c.rollout.prompts_per_step)
        groups, active, kind, source = [], [], [], []
        for si, (src, g) in enumerate(zip(self.sources, counts)):
            if g == 0:
                continue
            if src.algorithm == "sft":
                got, act, data_pos[src.name] = self._sft_groups(src, g, data_pos[src.name], stats)
            else:
                got, act, data_pos[src.name] = self._sampled_groups(
                    src, g, data_pos[src.name], seed * 31 + si, stats)
            k = {"sft": KIND_SFT, "opd": KIND_OPD}.get(src.algorithm, KIND_RL)
            groups += got
            active += act
            kind += [k] * (len(got) * n)
            source += [si] * (len(got) * n)
        rows = [r for grp in groups for r in grp[0]]
        rewards = np.concatenate([grp[1] for grp in groups])
        texts = [t for grp in groups for t in grp[2]]
        # Rows closed by a multi-turn prefix break follow the groups, padded to
        # whole pseudo-groups of n inactive-filled rows; each points at its episode.
        episode = list(range(len(rows)))
        overflow = [(gi * n + j, r) for gi, grp in enumerate(groups) for j, r in grp[3]]
        stats["overflow_rows"] = len(overflow)
        if overflow:
            pad = (-len(overflow)) % n
            filler_row = rollout_lib.Row(tokens=[self.pad_id], sampled=[0], logp=[0.0],
                                         env=[0], rewards=[0.0], truncated=False,
                                         version=self.version)
            rows += [r for _, r in overflow] + [filler_row] * pad
            episode += [p for p, _ in overflow] + [-1] * pad
            rewards = np.concatenate([rewards, rewards[[p for p, _ in overflow]],
                                      np.zeros(pad, np.float32)])
            kind += [kind[p] for p, _ in overflow] + [KIND_RL] * pad
            source += [source[p] for p, _ in overflow] + [0] * pad
            texts += [texts[p] for p, _ in overflow] + [""] * pad
        arrays = rollout_lib.assemble_rows(rows, bucket=c.rollout.length_bucket,
                                           pad_id=self.pad_id)
        episode = np.asarray(episode)
        active = np.repeat(active, n)
        if len(episode) > len(active):
            active = np.concatenate([active, episode[len(active):] >= 0])
            active[len(groups) * n:] &= active[np.maximum(episode[len(groups) * n:], 0)]
        # A sampler that returns garbage (non-finite log-probs, ids outside the
        # vocabulary) loses those rows, counted, instead of poisoning the step.
        bad = rollout_lib.bad_rows(arrays, self.tokenizer.vocab_size)
        if bad.any():
            log.warning("dropping %d rows with non-finite log-probs or invalid token ids "
                        "from the sampler", int(bad.sum()))
            arrays.tokens[bad] = self.pad_id
            arrays.behavior_logp[bad] = 0.0
            active = active & ~bad
        stats["bad_sampler_rows"] = int(bad.sum())
        episodes = stats.pop("_episodes", None)
        if episodes:
            from rljax.train import multiturn
            stats.update(multiturn.episode_metrics(episodes))
        stats["time_sample"] = time.perf_counter() - t0 - stats["time_score"]
        return Rollout(arrays=arrays, rewards=rewards, active=active, data_pos=data_pos,
                       texts=texts, stats=stats, kind=np.asarray(kind), source=np.asarray(source),
                       episode=episode, primary=len(groups) * n)

    # ------------------------------------------------------------- training

    def _source_config(self, src: Source):
        """The run config with `src`'s estimator (the recipe's own when None)."""
        if src.algorithm is None:
            return self.config
        from rljax.train import config as config_lib
        cfg = self.config.copy_and_resolve_references()
        cfg.advantage.baseline, cfg.advantage.scale = config_lib.ALGORITHMS[src.algorithm]
        return cfg

    def _streams(self, ro: Rollout, step: int):
        """Per-token streams of the whole rollout batch (host-side pre-pass).

        rl: advantages from each source's estimator on its own rows; ce: the
        sft rows' targets; ref_kl: the opd rows against their teacher.
        """
        c = self.config
        a = ro.arrays
        mask = a.loss_mask * ro.active[:, None]
        fresh = offpolicy.staleness_keep(a.version, self.version, c.offpolicy.max_staleness)
        keep = fresh & offpolicy.truncation_keep(a.truncated, c.offpolicy.mask_truncated)
        mask, dropped = offpolicy.apply_row_filter(jnp.asarray(mask), keep)
        stale = int(jnp.sum(~fresh))
        tokens = jnp.asarray(a.tokens)
        positions = jnp.asarray(a.positions)
        behavior = jnp.asarray(a.behavior_logp)
        old = ref = teacher = values = None
        if c.offpolicy.recompute_old_logp:
            old, _ = self.logprob_fn(self.state.params, tokens, positions)
        if self.ref_params is not None:
            ref, _ = self.logprob_fn(self.ref_params, tokens, positions)
        if self.value_fn is not None:
            values = self.value_fn(self.state.critic_params, tokens, positions)
        kind = np.asarray(ro.kind)
        rl_mask = mask * jnp.asarray(kind == KIND_RL, jnp.float32)[:, None]
        adv = jnp.zeros(mask.shape, jnp.float32)
        returns = None
        metrics = {}
        primary = ro.primary or len(kind)
        multiturn = bool(c.env.name)
        token_rewards = jnp.asarray(a.token_rewards) if multiturn else None
        for si, src in enumerate(self.sources):
            rows = np.nonzero((ro.source[:primary] == si) & (kind[:primary] == KIND_RL))[0]
            if rows.size == 0:
                continue
            sl = slice(rows[0], rows[-1] + 1)  # a source's group rows are contiguous
            st = objective.rl_streams(
                self._source_config(src), jnp.asarray(ro.rewards[sl]), rl_mask[sl],
                old_logp_BxT=(old if old is not None else behavior)[sl],
                ref_logp_BxT=None if ref is None else ref[sl],
                values_BxT=None if values is None else values[sl],
                token_rewards_BxT=None if token_rewards is None else token_rewards[sl])
            adv = adv.at[sl].set(st.advantages_BxT)
            rl_mask = rl_mask.at[sl].set(st.mask_BxT)
            if st.returns_BxT is not None:
                returns = jnp.zeros(mask.shape, jnp.float32).at[sl].set(st.returns_BxT)
            prefix = "" if len(self.sources) == 1 else f"{src.name}/"
            metrics.update({prefix + k: float(v) for k, v in st.metrics.items()})
        if primary < len(kind):
            # Multi-turn rows closed by a prefix break share their episode's
            # (outcome) advantage; a critic's GAE cannot bridge the break, so
            # under GAE they are dropped (counted).
            ep = np.maximum(ro.episode[primary:], 0)
            lens = jnp.maximum(jnp.sum(rl_mask[:primary], axis=1), 1.0)
            row_adv = jnp.sum(adv[:primary], axis=1) / lens
            extra_mask = rl_mask[primary:]
            if c.advantage.estimator == "gae":
                metrics["dropped_overflow_rows"] = int(np.sum(ro.episode[primary:] >= 0))
                extra_mask = jnp.zeros_like(extra_mask)
            rl_mask = rl_mask.at[primary:].set(extra_mask)
            adv = adv.at[primary:].set(row_adv[ep][:, None] * extra_mask)
        ce_w = ref_kl_w = None
        if (kind == KIND_SFT).any():
            w = np.array([self.sources[i].ce_weight for i in ro.source], np.float32)
            ce_w = mask * jnp.asarray(w * (kind == KIND_SFT))[:, None]
        echo = np.array([c.env.echo_weight if s.algorithm is None else
                         (s.ce_weight if s.algorithm == "echo" else 0.0)
                         for s in self.sources], np.float32)[ro.source]
        if multiturn and echo.any():
            # echo: cross-entropy on the environment's tokens after the first reply.
            env_w = jnp.asarray(a.env_mask) * jnp.asarray(ro.active, jnp.float32)[:, None]
            env_w = env_w * jnp.asarray(echo)[:, None]
            ce_w = env_w if ce_w is None else ce_w + env_w
        if (kind == KIND_OPD).any():
            ref_kl_w = mask * jnp.asarray(kind == KIND_OPD, jnp.float32)[:, None]
            teacher = jnp.zeros(mask.shape, jnp.float32)
            for si, src in enumerate(self.sources):
                if src.algorithm == "opd":
                    fn, params = self.teachers[src.name]
                    lp, _ = fn(params, tokens, positions)
                    on = jnp.asarray(ro.source == si)[:, None]
                    teacher = jnp.where(on, lp, teacher)
        streams = dict(tokens=tokens, positions=positions, behavior=behavior, old=old,
                       ref=ref, values=values, teacher=teacher, adv=adv, rl_mask=rl_mask,
                       returns=returns, ce_w=ce_w, ref_kl_w=ref_kl_w)
        metrics.update({"dropped_rows": int(dropped), "stale_rows": stale})
        return streams, metrics

    def train_on(self, ro: Rollout, step: int) -> dict:
        """All optimizer steps of one rollout batch (epochs x minibatches)."""
        c = self.config
        s, extra = self._streams(ro, step)
        a = ro.arrays
        n, mb = c.group_size, c.offpolicy.minibatches
        groups = len(ro.rewards) // n
        routing = None if a.routing is None else jnp.asarray(a.routing)
        versions = jnp.asarray(a.version)
        rng = np.random.default_rng([c.seed, step])
        norm = dict(mode=c.loss.norm, group_size=n, max_tokens=c.max_tokens)
        pick = lambda x, rows: None if x is None else x[rows]
        outs = []
        for _ in range(c.offpolicy.epochs):
            order = rng.permutation(groups) if mb > 1 else np.arange(groups)
            for chunk in np.array_split(order, mb):
                rows = (chunk[:, None] * n + np.arange(n)[None, :]).reshape(-1)
                # Axis 2 over the optimizer-step batch (this minibatch), per
                # component, before the step splits it into micro-batches.
                mask = s["rl_mask"][rows]
                batch = TrainBatch(
                    tokens=s["tokens"][rows], positions=s["positions"][rows], loss_mask=mask,
                    behavior_logp=s["behavior"][rows], advantages=s["adv"][rows],
                    coef=normalizers.coefficients(mask, **norm),
                    old_logp=pick(s["old"], rows), ref_logp=pick(s["ref"], rows),
                    teacher_logp=pick(s["teacher"], rows),
                    ce_coef=None if s["ce_w"] is None else normalizers.weighted_coefficients(
                        s["ce_w"][rows], **norm),
                    ref_kl_coef=None if s["ref_kl_w"] is None
                    else normalizers.weighted_coefficients(s["ref_kl_w"][rows], **norm),
                    routing=pick(routing, rows), policy_version=versions[rows],
                    returns=pick(s["returns"], rows), old_values=pick(s["values"], rows))
                self.state, m = self.train_step(self.state, batch)
                outs.append(m)
        host = jax.device_get(outs)
        metrics = {k: float(np.mean([o[k] for o in host])) for k in host[0]}
        metrics["skipped"] = int(sum(int(o["skipped"]) for o in host))
        metrics.update(extra)
        return metrics

    # ----------------------------------------------------------------- eval

    def evaluate(self) -> dict:
        """Held-out reward and accuracy: greedy, and sampled at the rollout temperature."""
        examples = self.task.eval_split(self.config.task.eval_size)
        if self.config.env.name:  # whole greedy episodes, scored by their return
            main = Source("eval", self.task, None)
            episodes, _ = self._episodes(main, examples, 1, seed=0, greedy=True)
            rewards = np.array([e.reward for e in episodes])
            return {"eval_reward": float(np.mean(rewards)),
                    "eval_accuracy": float(np.mean(rewards >= 1.0 - 1e-6))}
        prompts = [self.render(ex) for ex in examples]
        out = {}
        k = self.config.task.eval_samples
        # Greedy decoding, and (eval_samples > 0) k samples per prompt at the
        # rollout temperature: the distribution RL actually optimises.
        for prefix, temperature, n in [("eval", 0.0, 1), ("eval_sampled", None, k)]:
            if n <= 0:
                continue
            params = self._sampling_params(seed=12345, n=n)
            if temperature is not None:
                params = params.replace(temperature=temperature)
            with self._lock:
                comps = self.sampler.generate(prompts, params)
            rewards = np.array([self.task.reward(self._decode(cc.completion_ids), ex)
                                for cc, ex in zip(comps, np.repeat(examples, n))])
            out[f"{prefix}_reward"] = float(np.mean(rewards))
            out[f"{prefix}_accuracy"] = float(np.mean(rewards >= 1.0))
        return out

    # ------------------------------------------------------------------ run

    def _rollouts(self):
        """Yields rollouts: in line (sync) or from a thread running ahead (async)."""
        ahead = self.config.sampler.ahead
        if ahead <= 0:
            for step in range(self.start_step, self.config.steps):
                yield self.collect(self.data_pos, seed=self.config.seed * 100003 + step)
            return
        q: queue.Queue = queue.Queue(maxsize=ahead)
        stop = threading.Event()

        def produce():
            pos = self.data_pos
            for step in range(self.start_step, self.config.steps):
                if stop.is_set():
                    return
                try:
                    ro = self.collect(pos, seed=self.config.seed * 100003 + step)
                except Exception as e:  # surfaced in the training thread
                    q.put(e)
                    return
                pos = ro.data_pos
                while not stop.is_set():
                    try:
                        q.put(ro, timeout=0.5)
                        break
                    except queue.Full:
                        continue

        thread = threading.Thread(target=produce, daemon=True, name="rljax-sampler")
        thread.start()
        try:
            for _ in range(self.start_step, self.config.steps):
                item = q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=60)

    def run(self) -> dict:
        from tqdm import tqdm
        c = self.config
        summary = {"start_step": self.start_step}
        if self.start_step == 0:
            ev = self.evaluate()
            summary["eval_before"] = ev
            self.writer.write(0, {f"{k}": v for k, v in ev.items()})
        bar = tqdm(total=c.steps, initial=self.start_step, disable=not self.is_main,
                   desc="train", dynamic_ncols=True)
        t_run = time.perf_counter()
        step = self.start_step
        for step, ro in enumerate(self._rollouts(), start=self.start_step):
            t0 = time.perf_counter()
            m = self.train_on(ro, step)
            t_train = time.perf_counter() - t0
            m.update(self._rollout_metrics(ro))
            self.data_pos = ro.data_pos
            self.version += 1
            self.sampler.update_weights(self.state.params, self.version)
            if m["skipped"]:
                self.consecutive_skips += 1
                self.total_skips += m["skipped"]
                log.warning("step %d: non-finite loss or gradient, update skipped "
                            "(%d in a row)", step, self.consecutive_skips)
            else:
                self.consecutive_skips = 0
            m.update(ro.stats)
            m["time_train"] = t_train
            m["step_time"] = t_train + ro.stats["time_sample"] + ro.stats["time_score"]
            m["tokens_per_s"] = float(ro.arrays.loss_mask.sum()) / max(m["step_time"], 1e-9)
            m["total_skips"] = self.total_skips
            if c.train.eval_every and (step + 1) % c.train.eval_every == 0 and step + 1 < c.steps:
                m.update(self.evaluate())
            self.writer.write(step + 1, m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", step_s=f"{m['step_time']:.1f}")
            if self.consecutive_skips > c.train.max_consecutive_skips:
                self._save(step + 1, wait=True)
                raise RuntimeError(
                    f"{self.consecutive_skips} consecutive steps had a non-finite loss or "
                    f"gradient (train.max_consecutive_skips={c.train.max_consecutive_skips}); "
                    f"state saved at step {step + 1}, last good parameters kept")
            if (step + 1) % c.train.checkpoint_every == 0 or step + 1 == c.steps:
                self._save(step + 1)
        bar.close()
        summary["train_wall_s"] = time.perf_counter() - t_run
        ev = self.evaluate()
        summary["eval_after"] = ev
        self.writer.write(c.steps, ev)
        self.checkpointer.close()
        self.writer.close()
        return summary

    def _rollout_metrics(self, ro: Rollout) -> dict:
        r = ro.rewards[ro.active]
        lens = ro.arrays.completion_len[ro.active]
        if r.size == 0:
            return {"reward_mean": 0.0, "reward_std": 0.0, "pass_rate": 0.0,
                    "response_len": 0.0}
        finite = r[np.isfinite(r)]
        per_source = {}
        if len(self.sources) > 1:
            for si, src in enumerate(self.sources):
                rs = ro.rewards[ro.active & (ro.source == si)]
                rs = rs[np.isfinite(rs)]
                if rs.size:
                    per_source[f"reward_mean/{src.name}"] = float(np.mean(rs))
        return per_source | {
            "reward_mean": float(np.mean(finite)) if finite.size else 0.0,
            "reward_std": float(np.std(finite)) if finite.size else 0.0,
            "pass_rate": float(np.mean(finite >= 1.0)) if finite.size else 0.0,
            "response_len": float(np.mean(lens)),
            "truncated_frac": float(np.mean(ro.arrays.truncated[ro.active])),
            "staleness": float(np.mean(self.version - ro.arrays.version)),
        }


def train(config, workdir, *, sampler=None) -> dict:
    """Trains `config` in `workdir` (resuming from its latest checkpoint)."""
    return Trainer(config, workdir, sampler=sampler).run()


def evaluate_run(config, workdir) -> dict:
    """Held-out accuracy of the latest checkpoint in `workdir`."""
    trainer = Trainer(config, workdir)
    if trainer.start_step == 0:
        raise ValueError(f"{workdir} has no checkpoint to evaluate")
    out = {"step": trainer.start_step, **trainer.evaluate()}
    trainer.checkpointer.close()
    return out
