"""The run config: a recipe's five axes plus the trainer's sections.

Every field is commented here, once; configs/*.py only set values. The result
is locked (an unknown key fails) and validated.
"""

import ml_collections

from rljax import recipes


def add_trainer_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds model, optimizer, rollout, task, sampler and loop sections to `c`."""
    with c.unlocked():
        c.seed = 0                 # seeds init, data order, sampling
        c.steps = 40               # optimizer-step batches (rollout rounds)

        c.model = ml_collections.ConfigDict()
        c.model.source = "smollm2-135m-instruct"  # GGUF / HF dir / preset name (random init)
        c.model.param_dtype = "float32"
        c.model.compute_dtype = "float32"        # bfloat16 on accelerators
        c.model.remat = "none"                   # none | full | dots_saveable
        c.model.chunk_size = 256                 # log-prob chunk over the sequence

        c.optim = ml_collections.ConfigDict()
        c.optim.lr = 1e-6
        c.optim.schedule = "constant"   # constant | cosine (decays to lr * min_ratio)
        c.optim.warmup_steps = 0
        c.optim.min_ratio = 0.1
        c.optim.b1 = 0.9
        c.optim.b2 = 0.999
        c.optim.weight_decay = 0.0      # decoupled; only on matrices (not norms, biases)
        c.optim.grad_clip = 1.0         # global-norm clip; 0 turns it off

        c.rollout = ml_collections.ConfigDict()
        c.rollout.prompts_per_step = 8      # G groups per step; B = G * group_size
        c.rollout.temperature = 1.0         # sampling and trainer log-probs use it
        c.rollout.top_p = 1.0
        c.rollout.top_k = 0                 # 0: off
        c.rollout.max_prompt_tokens = 128   # longer prompts are skipped (counted)
        c.rollout.length_bucket = 32        # rows pad to a multiple of this

        c.task = ml_collections.ConfigDict()
        c.task.name = "arithmetic"          # see rljax.tasks.task_names()
        c.task.args = ml_collections.ConfigDict()  # the task's own fields
        c.task.reward_fn = ""               # "module:function" replaces the reward
        c.task.system_prompt = ""           # replaces the task's / template's default
        c.task.eval_size = 64               # held-out prompts, greedy decoding

        # Mixed batches: name -> source(...). Empty: one source, `task`, with
        # the recipe's own estimator.
        c.sources = ml_collections.ConfigDict()

        c.sampler = ml_collections.ConfigDict()
        c.sampler.kind = "inprocess"        # inprocess | remote
        c.sampler.url = ""                  # remote: base URL of `rljax serve`
        c.sampler.ahead = 0                 # async: batches generated ahead (0: sync)

        c.critic = ml_collections.ConfigDict()   # PPO (advantage.estimator='gae')
        c.critic.lr = 1e-5
        c.critic.clip = 0.2                 # value clipping around the old values
        c.critic.coef = 0.5                 # value-loss coefficient
        c.critic.init = "policy"            # policy (copy the trunk) | scratch

        c.train = ml_collections.ConfigDict()
        c.train.micro_batches = 1           # gradient accumulation per step
        c.train.max_consecutive_skips = 3   # non-finite steps in a row before stopping
        c.train.checkpoint_every = 10
        c.train.keep_checkpoints = 2
        c.train.eval_every = 0              # 0: only before and after
    return c


# Per-source algorithms (SPEC.md, "Per-source algorithms and loss components"):
# the outcome estimators set the advantage of the `rl` stream; `sft` and
# `opd` feed the `ce` and `ref_kl` components instead.
ALGORITHMS = {
    "grpo": ("group_mean", "group_std"),
    "max_rl": ("group_mean", "group_mean"),
    "rloo": ("leave_one_out", "none"),
    "dr_grpo": ("group_mean", "none"),
    "sft": None,
    "opd": None,
}


def source(task: str, *, weight: float = 1.0, algorithm: str = "grpo",
           args: dict | None = None, teacher: str = "", ce_weight: float = 1.0,
           reward_fn: str = "") -> ml_collections.ConfigDict:
    """One task source of a mixed batch (put it under `config.sources.<name>`).

    weight: share of `rollout.prompts_per_step` groups drawn from it.
    algorithm: grpo | max_rl | rloo | dr_grpo (an `rl` stream with that
      estimator), sft (`ce` on the task's reference answers), opd (`ref_kl` to
      `teacher` on the policy's own samples).
    teacher: opd only; a run directory (its latest checkpoint, same
      architecture) or a pretrained source with the policy's tokenizer.
    """
    s = ml_collections.ConfigDict()
    s.task = task
    s.args = ml_collections.ConfigDict(args or {})
    s.weight = float(weight)
    s.algorithm = algorithm
    s.teacher = teacher
    s.ce_weight = float(ce_weight)
    s.reward_fn = reward_fn
    return s


def get_config(recipe: str = "grpo", **overrides) -> ml_collections.ConfigDict:
    """The locked, validated run config of `recipe`, with `overrides`."""
    c = add_trainer_fields(recipes.get(recipe))
    recipes.apply_overrides(c, **overrides)
    return validate(c)


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """recipes.validate plus the trainer's own combinations."""
    recipes.validate(c)
    from rljax._checks import check_choice
    if "optim" not in c:
        return c
    check_choice("optim.schedule", c.optim.schedule, ("constant", "cosine"))
    check_choice("sampler.kind", c.sampler.kind, ("inprocess", "remote"))
    check_choice("model.remat", c.model.remat, ("none", "full", "dots_saveable"))
    if c.sampler.kind == "remote" and not c.sampler.url:
        raise ValueError("sampler.kind='remote' needs sampler.url")
    if c.steps < 1:
        raise ValueError(f"steps={c.steps} must be >= 1")
    if c.optim.lr <= 0:
        raise ValueError(f"optim.lr={c.optim.lr} must be > 0")
    b = c.rollout.prompts_per_step * c.group_size
    mb = c.offpolicy.minibatches
    if c.rollout.prompts_per_step % mb:
        raise ValueError(
            f"offpolicy.minibatches={mb} must divide rollout.prompts_per_step="
            f"{c.rollout.prompts_per_step} (minibatches hold whole groups)")
    if (b // mb) % c.train.micro_batches:
        raise ValueError(f"train.micro_batches={c.train.micro_batches} must divide "
                         f"the minibatch of {b // mb} rows")
    check_choice("critic.init", c.critic.init, ("policy", "scratch"))
    for name, src in c.sources.items():
        check_choice(f"sources.{name}.algorithm", src.algorithm, tuple(ALGORITHMS))
        if src.weight <= 0:
            raise ValueError(f"sources.{name}.weight={src.weight} must be > 0")
        if src.algorithm == "opd" and not src.teacher:
            raise ValueError(f"sources.{name}.algorithm='opd' needs sources.{name}.teacher")
        if src.algorithm == "rloo" and c.group_size < 2:
            raise ValueError(f"sources.{name}.algorithm='rloo' needs group_size >= 2")
    if len(c.sources) and c.advantage.estimator == "gae":
        raise ValueError("config.sources mixes outcome estimators; advantage.estimator="
                         "'gae' (PPO) trains a single task with its critic")
    if c.rollout.temperature <= 0:
        raise ValueError("rollout.temperature must be > 0 for training (the "
                         "behavior log-probs need a distribution)")
    return c
