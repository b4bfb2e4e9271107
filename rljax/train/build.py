"""Everything a run needs, built once: config -> a frozen `Run` and the first state.

`build(config, workdir)` resolves the task sources (each one's loss
component, estimator, weights and teacher), loads or initialises the policy
on the mesh, and builds the optimizer, critic, frozen reference, sampler and
the jitted programs. This is the only place an algorithm name is read
(`config_lib.ALGORITHMS`); after it a source is a `Source` record and an
`objective.SourceSpec`, and the loss sees only streams.
"""

import dataclasses
import logging
import pathlib
import threading
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import objective as objective_lib
from rljax import parallel
from rljax.batch import Rollout
from rljax.train import checkpoint as ckpt_lib
from rljax.train import collect
from rljax.train import config as config_lib
from rljax.train import rows as rows_lib
from rljax.train import step as step_lib

log = logging.getLogger("rljax.train")

# (policy params, rollout) -> the teacher's log-probs on the rollout's grid.
Teacher = Callable[[Any, Rollout], jax.Array]


@dataclasses.dataclass(frozen=True)
class Source:
    """One task source, resolved: where its rows come from and how they train.

    share: its share of `rollout.prompts_per_step` groups.
    spec: how its rows enter the loss (component, estimator, weights).
    produce: how its groups are made, `(run, source, count, data_pos, *, seed,
      version, stats, episodes) -> (groups, active, data_pos)`:
      `collect.sampled_groups` (the policy's own samples, single- or
      multi-turn) or `collect.reference_groups` (the task's answers). Another
      producer (an environment harness) plugs in here.
    dynamic_sampling: resample groups whose rewards are all equal (DAPO).
    hint: the template of a prompt only the teacher sees ("" for none).
    teacher_kind: how its teacher is built: "" none, `frozen` (opd), `self` (opsd).
    teacher: (params, rollout) -> teacher log-probs, once built (`with_teachers`).
    """

    name: str
    task: Any
    share: float
    spec: objective_lib.SourceSpec
    produce: Callable = collect.sampled_groups
    dynamic_sampling: bool = False
    hint: str = ""
    teacher_kind: str = ""
    teacher: Optional[Teacher] = None


@dataclasses.dataclass(frozen=True)
class Programs:
    """The model side of a run: mesh, shardings, jitted programs, frozen weights."""

    mesh: Any
    rules: Any
    state_sharding: Any
    batch_sharding: Any
    train_step: parallel.ShardedFn
    logprob_fn: parallel.ShardedFn          # (params, tokens, positions) -> (logp, entropy)
    value_fn: Optional[parallel.ShardedFn]  # (critic params, tokens, positions) -> values
    # (policy params, tokens, positions) -> the reference's log-probs (KL): by
    # default the initial policy, frozen; None when no KL needs it.
    reference_logp: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class Run:
    """A run's fixed parts. Collection needs only the first six fields.

    task: the held-out evaluation task (config.task). objective: the resolved
    composition. programs: None in a Run built by hand for collection tests.
    lock: serialises sampler calls between the async producer and evaluation.
    """

    config: Any
    tokenizer: Any
    sources: tuple
    task: Any
    sampler: Any
    objective: objective_lib.Objective
    programs: Optional[Programs] = None
    workdir: Optional[pathlib.Path] = None
    lock: Any = dataclasses.field(default_factory=threading.Lock)

    @property
    def stop_ids(self) -> tuple:
        return tuple(i for i in [self.tokenizer.eos_token_id] if i is not None)

    @property
    def pad_id(self) -> int:
        return pad_id_of(self.tokenizer)

    def logprobs(self, state, rollout: Rollout) -> objective_lib.Logprobs:
        """The model outputs the objective needs, at `state` (the start of the batch)."""
        p = self.programs
        tokens = jnp.asarray(rollout.tokens_BxT)
        positions = jnp.asarray(rollout.positions_BxT)
        old = ref = values = teacher = None
        if self.objective.recompute_old_logp:
            old, _ = p.logprob_fn(state.params, tokens, positions)
        if p.reference_logp is not None:
            ref = p.reference_logp(state.params, tokens, positions)
        if p.value_fn is not None:
            values = p.value_fn(state.critic_params, tokens, positions)
        for si, src in enumerate(self.sources):
            on_B = np.asarray(rollout.source_B) == si
            if src.teacher is None or not on_B.any():
                continue
            lp = src.teacher(state.params, rollout)
            teacher = jnp.where(jnp.asarray(on_B)[:, None], lp,
                                0.0 if teacher is None else teacher)
        return objective_lib.Logprobs(old, ref, teacher, values)


def pad_id_of(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return pad if pad is not None else (tokenizer.eos_token_id or 0)


def build_task(config, name=None, args=None, reward_fn=None):
    """A task from the config (or from a source's name/args/reward_fn)."""
    from rljax import tasks
    kwargs = dict((config.task.args if args is None else args).to_dict())
    reward_fn = config.task.reward_fn if reward_fn is None else reward_fn
    if reward_fn:
        kwargs["reward_fn"] = reward_fn
    return tasks.get_task(name or config.task.name, seed=config.seed, **kwargs)


def resolve_sources(config) -> tuple:
    """`config.sources` by name, or one `main` source of config.task (the recipe's estimator).

    Pure: no model is touched; teachers are attached later (`with_teachers`).
    """
    if not len(config.sources):
        spec = objective_lib.SourceSpec("main", "rl", objective_lib.Estimator.from_config(config),
                                        env_weight=config.env.echo_weight)
        return (Source("main", build_task(config), 1.0, spec,
                       dynamic_sampling=config.dapo.dynamic_sampling),)
    out = []
    for name, s in sorted(config.sources.items()):
        alg = config_lib.ALGORITHMS[s.algorithm]
        estimator = (objective_lib.Estimator.from_config(config, baseline=alg.baseline,
                                                         scale=alg.scale)
                     if alg.component == "rl" else None)
        spec = objective_lib.SourceSpec(
            name, alg.component, estimator,
            weight=s.ce_weight if alg.component == "ce" else 1.0,
            env_weight=s.ce_weight if alg.echo else 0.0)
        out.append(Source(name, build_task(config, s.task, s.args, s.reward_fn), s.weight, spec,
                          produce=(collect.reference_groups if alg.rows == "reference"
                                   else collect.sampled_groups),
                          dynamic_sampling=config.dapo.dynamic_sampling and alg.component == "rl",
                          hint=s.get("hint", ""), teacher_kind=alg.teacher))
    return tuple(out)


def with_teachers(config, sources: tuple, state, programs: "Programs", tokenizer) -> tuple:
    """`sources` with the teacher of every `frozen` (opd) and `self` (opsd) source built."""
    out = []
    for s in sources:
        if s.teacher_kind == "self":
            s = dataclasses.replace(s, teacher=self_teacher(
                programs.logprob_fn, bucket=config.rollout.length_bucket,
                pad_id=pad_id_of(tokenizer)))
        elif s.teacher_kind == "frozen":
            s = dataclasses.replace(s, teacher=frozen_teacher(
                config, s.name, config.sources[s.name].teacher, state, programs, tokenizer))
        out.append(s)
    return tuple(out)


def preset_tokenizer(tasks):
    """A random-init preset's tokenizer: the tasks' own character tokenizers, merged.

    Toy tasks ship a CharTokenizer over their characters; sources with
    different alphabets or separators need one vocabulary holding them all
    (the first task's characters first, so one task keeps its ids). None
    when no task ships a tokenizer.
    """
    toks = [t.tokenizer() for t in tasks if hasattr(t, "tokenizer")]
    if not toks or not all(hasattr(t, "chars") for t in toks):
        return toks[0] if toks else None
    return type(toks[0])("".join(dict.fromkeys("".join(t.chars for t in toks))))


def build_policy(config, tasks, mesh=None, rules=parallel.DEFAULT_RULES):
    """(model, tokenizer): pretrained weights, or a preset initialised from the seed.

    A preset (e.g. `tiny`) trains from scratch with the tasks' own character
    tokenizer (`preset_tokenizer`), sized to its vocabulary. With a `mesh`, a
    preset is initialised already sharded (parallel.init_sharded).
    """
    from rljax.models import config as model_config
    from rljax.models import loading
    from rljax.models import transformer
    m = config.model
    dtypes = dict(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat,
                  attention=m.attention)
    blocks = dict(attention_block_q=m.attention_block, attention_block_kv=m.attention_block)
    if m.source in model_config.preset_names():
        tok = preset_tokenizer(tasks)
        if tok is None:
            raise ValueError(f"model.source={m.source!r} is a random-init preset; it needs a "
                             f"task with its own tokenizer (toy tasks), not {config.task.name!r}")
        cfg = model_config.get_preset(m.source, vocab_size=tok.vocab_size, **dtypes, **blocks)
        make = lambda: transformer.Decoder(cfg, rngs=nnx.Rngs(config.seed))  # noqa: E731
        if mesh is None:
            return make(), tok
        return nnx.merge(*parallel.init_sharded(make, mesh, rules)), tok
    return loading.load_pretrained(m.source, **dtypes, **blocks)


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


def frozen_logp(logprob_fn, params) -> Callable:
    """(policy params, tokens, positions) -> log-probs of fixed `params` (a frozen copy)."""
    def logp(policy_params, tokens_BxT, positions_BxT):
        del policy_params
        return logprob_fn(params, tokens_BxT, positions_BxT)[0]
    return logp


def frozen_teacher(config, name: str, path: str, state, programs: Programs,
                   tokenizer) -> Teacher:
    """opd: a run directory's latest checkpoint (same architecture) or a pretrained model."""
    run_dir = pathlib.Path(path)
    if (run_dir / "checkpoints").is_dir():
        checkpointer = ckpt_lib.Checkpointer(run_dir / "checkpoints")
        got = checkpointer.restore(ckpt_lib.abstract(state))
        checkpointer.close()
        if got is None:
            raise ValueError(f"sources.{name}.teacher={path!r} has no checkpoint")
        fn, params = programs.logprob_fn, got[1].params
    else:
        from rljax.models import loading
        teacher = loading.load_model(path)
        if teacher.config.vocab_size != tokenizer.vocab_size:
            raise ValueError(
                f"sources.{name}.teacher={path!r} has a vocabulary of "
                f"{teacher.config.vocab_size}, the policy's tokenizer {tokenizer.vocab_size}")
        graphdef, params = nnx.split(teacher)
        fn = parallel.ShardedFn(step_lib.make_logprob_fn(
            graphdef, temperature=config.rollout.temperature,
            chunk_size=config.model.chunk_size), programs.batch_sharding, feed=(1, 2),
            local_outputs=True)
        params = parallel.shard_params(params, programs.mesh, programs.rules)

    def teacher_logp(policy_params, rollout: Rollout):
        del policy_params  # frozen
        return fn(params, jnp.asarray(rollout.tokens_BxT),
                  jnp.asarray(rollout.positions_BxT))[0]
    return teacher_logp


def self_teacher(logprob_fn, *, bucket: int, pad_id: int) -> Teacher:
    """opsd: the live policy scoring each row's own completion after its hint prompt.

    Row b's teacher sequence is `teacher_prompts[b] + tokens[prompt_len:end]`
    (end: past the last completion token); its log-prob of the completion
    token at grid position t sits at `t - prompt_len + len(hint)` and is
    moved back to t. Rows without a hint get 0 (their ref_kl weight is 0).
    """

    def teacher_logp(params, rollout: Rollout):
        b, t = rollout.shape
        hints = rollout.teacher_prompts or (None,) * b
        mask_BxT = np.asarray(rollout.loss_mask_BxT) > 0
        end_B = np.where(mask_BxT.any(1), t - np.argmax(mask_BxT[:, ::-1], axis=1), 0)
        start_B = np.asarray(rollout.prompt_len_B)
        seqs = [[pad_id] if h is None else
                list(h) + np.asarray(rollout.tokens_BxT)[i, start_B[i]:end_B[i]].tolist()
                for i, h in enumerate(hints)]
        u = rows_lib.bucket_length(max(map(len, seqs)), bucket)
        grid_BxU = np.full((b, u), pad_id, np.int32)
        for i, seq in enumerate(seqs):
            grid_BxU[i, :len(seq)] = seq
        positions_BxU = np.broadcast_to(np.arange(u, dtype=np.int32), (b, u))
        lp_BxU = np.asarray(logprob_fn(params, jnp.asarray(grid_BxU),
                                       jnp.asarray(positions_BxU))[0])
        out_BxT = np.zeros((b, t), np.float32)
        for i, h in enumerate(hints):
            if h is not None:
                cols = np.arange(start_B[i], end_B[i])
                out_BxT[i, cols] = lp_BxU[i, cols - start_B[i] + len(h)]
        return jnp.asarray(out_BxT)
    return teacher_logp


def build(config, workdir, *, sampler=None):
    """(Run, TrainState) for `config` in `workdir`; `sampler` replaces the built one."""
    parallel.initialize(config)  # multi-host: before anything touches a device
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    mesh = parallel.make_mesh(config.mesh)
    rules = parallel.rules_from_config(config)
    log.info("mesh %s", parallel.describe(mesh))
    sources = resolve_sources(config)
    task = build_task(config)
    model, tokenizer = build_policy(config, [s.task for s in sources] + [task], mesh, rules)
    graphdef, params = nnx.split(model)
    params = parallel.shard_params(params, mesh, rules)  # loaded weights
    optimizer = step_lib.make_optimizer(config.optim, config.steps)
    objective = objective_lib.Objective.from_config(
        config, sources=tuple(s.spec for s in sources))
    critic_params = critic_opt = critic_graphdef = None
    if objective.needs_values:
        from rljax.models import ValueModel
        critic = (ValueModel.from_policy(model) if config.critic.init == "policy"
                  else ValueModel(model.config, rngs=nnx.Rngs(config.seed + 1)))
        critic_graphdef, critic_params = nnx.split(critic)
        critic_params = parallel.shard_params(critic_params, mesh, rules)
        optim = config.optim.copy_and_resolve_references()
        with optim.unlocked():
            optim.lr = config.critic.lr
        critic_opt = step_lib.make_optimizer(optim, config.steps)
    # eval_shape -> shardings -> jit(init, out_shardings): moments sharded like params.
    state, state_sharding = parallel.init_state_sharded(
        lambda p, cp: step_lib.init_state(p, optimizer, cp, critic_opt),
        mesh, rules, params, critic_params)
    # Batches arrive as host data; each process feeds the rows its devices hold.
    batch_sharding = parallel.batch_sharding(mesh, rules)
    value_fn = None if critic_graphdef is None else parallel.ShardedFn(
        step_lib.make_value_fn(critic_graphdef), batch_sharding, feed=(1, 2),
        local_outputs=True)
    programs = Programs(
        mesh=mesh, rules=rules, state_sharding=state_sharding, batch_sharding=batch_sharding,
        train_step=parallel.ShardedFn(step_lib.make_train_step(
            config, graphdef, optimizer, micro_batches=config.train.micro_batches,
            chunk_size=config.model.chunk_size, critic_graphdef=critic_graphdef,
            critic_optimizer=critic_opt, state_sharding=state_sharding,
            batch_sharding=batch_sharding), batch_sharding, feed=(1,)),
        logprob_fn=parallel.ShardedFn(step_lib.make_logprob_fn(
            graphdef, temperature=config.rollout.temperature,
            chunk_size=config.model.chunk_size), batch_sharding, feed=(1, 2),
            local_outputs=True),
        value_fn=value_fn)
    if objective.needs_ref_logp:
        # The reference policy is the initial one, frozen.
        programs = dataclasses.replace(programs, reference_logp=frozen_logp(
            programs.logprob_fn, jax.tree.map(jnp.copy, params)))
    if sampler is None:
        sampler = build_sampler(config, model, rules, sync_dir=str(workdir / "sampler_sync"))
    sources = with_teachers(config, sources, state, programs, tokenizer)
    run = Run(config=config, tokenizer=tokenizer, sources=sources, task=task,
              sampler=sampler, objective=objective, programs=programs, workdir=workdir)
    return run, state
