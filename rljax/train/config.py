"""The run config: a recipe's five axes plus the trainer's sections.

Every field is commented here, once; configs/*.py only set values. The result
is locked (an unknown key fails) and validated.
"""

import dataclasses
import math
import string

import ml_collections

from rljax import parallel
from rljax import recipes


def add_trainer_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds model, optimizer, rollout, task, sampler and loop sections to `c`."""
    with c.unlocked():
        # The defaults are the main job (`rljax train` with no flags): GRPO on
        # SmolLM2-135M-Instruct, arithmetic with an exact "just the number"
        # reward, sized for about ten minutes on 2 CPU cores.
        c.seed = 0                 # seeds init, data order, sampling
        c.steps = 12               # optimizer-step batches (rollout rounds)
        c.max_tokens = 12          # room for "a + b = c" and EOS; the number alone is 3
        c.group_size = 8
        c.dapo.overlong_buffer = 4

        c.model = ml_collections.ConfigDict()
        c.model.source = "smollm2-135m-instruct"  # GGUF / HF dir / preset name (random init)
        c.model.param_dtype = "float32"
        c.model.compute_dtype = "float32"        # bfloat16 on accelerators
        # auto: full remat for a forward over >= 4096 tokens (B*T), else none
        c.model.remat = "auto"                   # auto | none | full | dots_saveable
        # auto: splash on TPU, cuDNN on NVIDIA GPUs, blockwise (flash-style,
        # linear memory) from 1k tokens elsewhere, xla einsum below.
        c.model.attention = "auto"               # auto | xla | blockwise | cudnn | splash
        c.model.attention_block = 512            # query/key tile of blockwise and splash
        c.model.chunk_size = 256                 # log-prob chunk over the sequence

        c.optim = ml_collections.ConfigDict()
        c.optim.lr = 1e-5
        c.optim.schedule = "constant"   # constant | cosine (decays to lr * min_ratio)
        c.optim.warmup_steps = 0
        c.optim.min_ratio = 0.1
        c.optim.b1 = 0.9
        c.optim.b2 = 0.999
        c.optim.weight_decay = 0.0      # decoupled; only on matrices (not norms, biases)
        c.optim.grad_clip = 1.0         # global-norm clip; 0 turns it off

        c.rollout = ml_collections.ConfigDict()
        c.rollout.prompts_per_step = 4      # G groups per step; B = G * group_size
        c.rollout.temperature = 1.0         # sampling and trainer log-probs use it
        c.rollout.top_p = 1.0
        c.rollout.top_k = 0                 # 0: off
        c.rollout.max_prompt_tokens = 128   # longer prompts are skipped (counted)
        c.rollout.length_bucket = 32        # rows pad to a multiple of this

        c.task = ml_collections.ConfigDict()
        c.task.name = "arithmetic"          # see rljax.tasks.task_names()
        # The task's own fields; a config for another task replaces the whole dict.
        c.task.args = ml_collections.ConfigDict(
            dict(max_value=30, operators="+"))
        c.task.reward_fn = ""               # "module:function" replaces the reward
        c.task.system_prompt = "You are a calculator. Reply with only the number."
        # (replaces the task's / chat template's default; "" keeps it)
        c.task.eval_size = 64               # held-out prompts, greedy decoding
        c.task.eval_samples = 4             # also: samples per prompt at the rollout temperature

        # Mixed batches: name -> source(...). Empty: one source, `task`, with
        # the recipe's own estimator.
        c.sources = ml_collections.ConfigDict()

        c.env = ml_collections.ConfigDict()      # multi-turn episodes (rljax.envs)
        c.env.name = ""                     # "" single-turn | calculator | python | toy_multiturn
        c.env.max_turns = 4                 # assistant turns per episode
        c.env.token_budget = 256            # sampled tokens per episode, then it ends
        c.env.over_budget_reward = 0.0      # reward of an episode that ran out of budget
        c.env.max_row_tokens = 1024         # a row longer than this ends its episode
        c.env.echo_weight = 0.0             # ce weight on env tokens (echo: 0.1)
        c.env.args = ml_collections.ConfigDict()  # the environment's own fields

        c.sampler = ml_collections.ConfigDict()
        c.sampler.kind = "inprocess"        # inprocess | remote
        c.sampler.url = ""                  # remote: base URL of `rljax serve`
        c.sampler.sync_dir = ""             # remote: weights dir the server reads ("": <workdir>/sampler_sync)
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

        # Device mesh of the trainer (rljax.parallel, docs/scale_out.md). The
        # product of the sizes is the device count; one may be -1 (the rest).
        c.mesh = ml_collections.ConfigDict()
        c.mesh.data = -1                    # data parallel, params replicated
        c.mesh.fsdp = 1                     # data parallel, params + optimizer state sharded
        c.mesh.tensor = 1                   # heads / mlp / vocab split (within a host)
        c.mesh.expert = 1                   # MoE experts split
        c.mesh.sampler_tensor = 1           # in-process sampler: its own (data, tensor) mesh
                                            # over each process's devices, this tensor size

        # Logical axis name -> mesh axes ("a,b"; "" replicates). Parameters use
        # vocab/embed/heads/kv_heads/head_dim/mlp/experts, activations batch/length.
        c.logical_axis_rules = ml_collections.ConfigDict()
        for name, axes in parallel.DEFAULT_RULES:
            c.logical_axis_rules[name] = ",".join(axes)

        # Multi-host start-up (jax.distributed, one process per host).
        c.distributed = ml_collections.ConfigDict()
        c.distributed.initialize = "auto"   # auto (a coordinator is named or a multi-host TPU /
                                            # SLURM / MPI job is detected) | yes | no
        c.distributed.coordinator_address = ""  # "host:port" of process 0; "" reads
                                                # $JAX_COORDINATOR_ADDRESS or auto-detects
        c.distributed.num_processes = 0     # 0: $JAX_NUM_PROCESSES or auto-detected
        c.distributed.process_id = -1       # -1: $JAX_PROCESS_ID or auto-detected
        c.distributed.local_device_ids = "" # "0,1,2,3": this process's GPUs; "" = all visible
    return c


# Per-source algorithms (docs/algorithms.md §9). An algorithm only says which
# loss component a source's rows feed and where they come from; train/build.py
# reads this table once, and nothing after it sees the name.
@dataclasses.dataclass(frozen=True)
class Algorithm:
    """component: rl | ce | ref_kl. baseline/scale: the estimator an rl source
    swaps into the recipe's advantage. rows: `sampled` (the policy's own) or
    `reference` (the task's answers). teacher: `frozen` (sources.<name>.teacher)
    or `self` (the live policy, prompted with sources.<name>.hint). echo: also
    `ce` on the environment tokens of multi-turn rows."""

    component: str
    baseline: str | None = None
    scale: str | None = None
    rows: str = "sampled"
    teacher: str = ""
    echo: bool = False


ALGORITHMS = {
    "grpo": Algorithm("rl", "group_mean", "group_std"),
    "max_rl": Algorithm("rl", "group_mean", "group_mean"),
    "rloo": Algorithm("rl", "leave_one_out", "none"),
    "dr_grpo": Algorithm("rl", "group_mean", "none"),
    "echo": Algorithm("rl", "group_mean", "group_std", echo=True),
    "sft": Algorithm("ce", rows="reference"),
    "opd": Algorithm("ref_kl", teacher="frozen"),
    "opsd": Algorithm("ref_kl", teacher="self"),
}

# The teacher's prompt of an opsd source: the task's prompt with its
# reference answer, which the student never sees. Fields: {prompt}, {answer}.
DEFAULT_HINT = "{prompt}\n\n(A correct answer is: {answer})"
HINT_FIELDS = ("prompt", "answer")


def source(task: str, *, weight: float = 1.0, algorithm: str = "grpo",
           args: dict | None = None, teacher: str = "", ce_weight: float = 1.0,
           reward_fn: str = "", hint: str = "") -> ml_collections.ConfigDict:
    """One task source of a mixed batch (put it under `config.sources.<name>`).

    weight: share of `rollout.prompts_per_step` groups drawn from it.
    algorithm: grpo | max_rl | rloo | dr_grpo | echo (an `rl` stream with that
      estimator), sft (`ce` on the task's reference answers), opd (`ref_kl` to
      `teacher` on the policy's own samples), opsd (`ref_kl` to the live policy
      prompted with `hint`).
    teacher: opd only; a run directory (its latest checkpoint, same
      architecture) or a pretrained source with the policy's tokenizer.
    ce_weight: sft's target weight; echo's weight on environment tokens
      (default 0.1 for echo, docs/algorithms.md §9).
    hint: opsd only; the teacher's user message, a format string over
      {prompt} and {answer} (default DEFAULT_HINT).
    """
    if algorithm == "echo" and ce_weight == 1.0:
        ce_weight = 0.1
    if algorithm == "opsd" and not hint:
        hint = DEFAULT_HINT
    s = ml_collections.ConfigDict()
    s.task = task
    s.args = ml_collections.ConfigDict(args or {})
    s.weight = float(weight)
    s.algorithm = algorithm
    s.teacher = teacher
    s.ce_weight = float(ce_weight)
    s.reward_fn = reward_fn
    s.hint = hint
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
    from rljax.models import config as model_config
    check_choice("model.remat", c.model.remat, model_config.REMAT_POLICIES)
    check_choice("model.attention", c.model.attention, model_config.ATTENTION_IMPLEMENTATIONS)
    if not isinstance(c.model.attention_block, int) or c.model.attention_block <= 0:
        raise ValueError(f"model.attention_block={c.model.attention_block!r} must be a positive integer")
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
    if "mesh" in c:
        _validate_mesh(c, b // mb // c.train.micro_batches)
    for name, src in c.sources.items():
        check_choice(f"sources.{name}.algorithm", src.algorithm, tuple(ALGORITHMS))
        if src.weight <= 0:
            raise ValueError(f"sources.{name}.weight={src.weight} must be > 0")
        if src.algorithm == "opd" and not src.teacher:
            raise ValueError(f"sources.{name}.algorithm='opd' needs sources.{name}.teacher")
        if src.algorithm != "opd" and src.teacher:
            raise ValueError(f"sources.{name}.teacher is read only by algorithm='opd' "
                             f"(got algorithm={src.algorithm!r})")
        if src.algorithm == "rloo" and c.group_size < 2:
            raise ValueError(f"sources.{name}.algorithm='rloo' needs group_size >= 2")
        _validate_hint(c, name, src)
    if len(c.sources) and c.advantage.estimator == "gae":
        raise ValueError("config.sources mixes outcome estimators; advantage.estimator="
                         "'gae' (PPO) trains a single task with its critic")
    if c.rollout.temperature <= 0:
        raise ValueError("rollout.temperature must be > 0 for training (the "
                         "behavior log-probs need a distribution)")
    return c


def _validate_hint(c: ml_collections.ConfigDict, name: str, src) -> None:
    """An opsd source's hint template, and only opsd reads one."""
    hint = src.get("hint", "")
    if src.algorithm != "opsd":
        if hint:
            raise ValueError(f"sources.{name}.hint is read only by algorithm='opsd' "
                             f"(got algorithm={src.algorithm!r})")
        return
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(hint) if f is not None}
    except ValueError as e:
        raise ValueError(f"sources.{name}.hint={hint!r} is not a format string: {e}") from None
    bad = sorted(fields - set(HINT_FIELDS))
    if bad or "answer" not in fields:
        raise ValueError(f"sources.{name}.hint={hint!r} must use {{answer}} and only the "
                         f"fields {', '.join('{' + f + '}' for f in HINT_FIELDS)}"
                         + (f"; unknown: {bad}" if bad else ""))
    if c.env.name:
        raise ValueError(f"sources.{name}.algorithm='opsd' scores single-turn rows; "
                         f"env.name={c.env.name!r} makes multi-turn episodes")


def _validate_mesh(c: ml_collections.ConfigDict, rows_per_micro_batch: int) -> None:
    """Mesh sizes, rule axes and the start-up mode; device counts are checked at start-up."""
    from rljax._checks import check_choice
    sizes = {a: c.mesh[a] for a in parallel.MESH_AXES}
    bad = [a for a, s in sizes.items() if not isinstance(s, int) or s == 0 or s < -1]
    if bad or sum(s == -1 for s in sizes.values()) > 1:
        raise ValueError(f"mesh.{bad[0] if bad else 'data'}: sizes must be >= 1 with at most one "
                         f"-1 (the devices left over); got {sizes}")
    if c.mesh.sampler_tensor < 1:
        raise ValueError(f"mesh.sampler_tensor={c.mesh.sampler_tensor} must be >= 1")
    parallel.parse_rules(dict(c.logical_axis_rules))  # names the bad rule
    check_choice("distributed.initialize", c.distributed.initialize, ("auto", "yes", "no"))
    rules = dict(parallel.parse_rules(dict(c.logical_axis_rules)))
    split = [sizes[a] for a in rules.get("batch", ()) if sizes[a] > 1]
    if split and rows_per_micro_batch % math.prod(split):
        raise ValueError(
            f"a micro-batch of {rows_per_micro_batch} rows cannot be split over the batch axes "
            f"({'x'.join(map(str, split))} = {math.prod(split)} devices); change "
            f"rollout.prompts_per_step, group_size, offpolicy.minibatches or train.micro_batches")


# Free-form sections: their keys belong to the task / environment / sources
# the run chose, so a saved run replaces them whole instead of merging.
_FREE_FORM = ("args", "sources")


def _overlay(node: ml_collections.ConfigDict, values: dict) -> None:
    for key, value in values.items():
        if (isinstance(value, dict) and key not in _FREE_FORM
                and isinstance(node.get(key), ml_collections.ConfigDict)):
            _overlay(node[key], value)
        else:
            with node.unlocked():
                node[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value


def load_run_config(run_dir) -> ml_collections.ConfigDict:
    """A run directory's config.json over today's defaults of its recipe.

    Fields added to rljax after the run keep their defaults; everything the run
    recorded wins. Read-only: nothing in `run_dir` changes. Locked, validated.
    """
    import json
    import pathlib
    saved = json.loads((pathlib.Path(run_dir) / "config.json").read_text())
    config = get_config(saved.get("recipe", "grpo"))
    _overlay(config, saved)
    return validate(config)
