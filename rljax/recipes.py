"""Named recipes: each published algorithm is one setting of the five axes.

`get(name, **overrides)` returns a locked, validated ml_collections ConfigDict
with the algorithm fields below; the trainer's configs (configs/base.py) add
model, optimizer and task fields around it. Every field is commented in
`_base()`. Overrides may be nested dicts (`loss={"eps_high": 0.3}`) or dotted
keys (`**{"loss.eps_high": 0.3}`).
"""

import dataclasses
from typing import Any, Callable

import ml_collections

from rljax import advantages as adv_lib
from rljax import kl as kl_lib
from rljax import normalizers
from rljax import offpolicy
from rljax import surrogates

ESTIMATORS = ("group", "gae")


def _base() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.recipe = "grpo"          # name of the preset this config started from
    c.group_size = 8           # n rows per prompt (groups of consecutive rows)
    c.max_tokens = 512         # L_max, the generation limit (Dr. GRPO, overlong)

    c.advantage = ml_collections.ConfigDict()
    c.advantage.estimator = "group"       # group (outcome) | gae (critic)
    c.advantage.baseline = "group_mean"   # group_mean | leave_one_out | none
    c.advantage.scale = "group_std"       # none | group_std | batch_std | group_mean
    c.advantage.ddof = 0                  # std's ddof; 0 = population (TRL async, MaxText)
    c.advantage.eps = 1e-6                # added to the std (verl 1e-6, TRL 1e-4)
    c.advantage.gamma = 1.0               # GAE discount
    c.advantage.lam = 0.95                # GAE lambda
    c.advantage.whiten = False            # GAE: whiten advantages over the batch

    c.loss = ml_collections.ConfigDict()
    c.loss.norm = "seq_mean_token_mean"   # axis 2, see normalizers.MODES
    c.loss.type = "clip"                  # axis 3, see surrogates.TYPES
    for k, v in surrogates.DEFAULTS.items():  # trust-region parameters
        setattr(c.loss, k, v)

    c.offpolicy = ml_collections.ConfigDict()
    c.offpolicy.recompute_old_logp = False  # pi_old from the trainer, else pi_old := mu
    c.offpolicy.level = "none"              # behavior correction: none | token | sequence | geometric
    c.offpolicy.mode = "truncate"           # truncate (TIS, min(w, cap)) | mask
    c.offpolicy.cap = 2.0                   # TIS cap C
    c.offpolicy.low = 0.5                   # mask mode: keep low <= w <= high
    c.offpolicy.high = 2.0
    c.offpolicy.max_staleness = 1           # drop rows sampled more versions ago
    c.offpolicy.mask_truncated = False      # drop rows that hit max_tokens unstopped
    c.offpolicy.epochs = 1                  # passes over each rollout batch
    c.offpolicy.minibatches = 1             # optimizer steps per pass

    c.kl = ml_collections.ConfigDict()
    c.kl.placement = "none"   # none | loss (l += beta kl) | reward (r -= beta kl)
    c.kl.estimator = "k3"     # k1 | k2 | k3 | low_var_kl
    c.kl.beta = 0.0

    c.dapo = ml_collections.ConfigDict()
    c.dapo.dynamic_sampling = False   # drop all-equal groups, resample
    c.dapo.max_sampling_rounds = 4    # bound on resampling rounds per step
    c.dapo.overlong = False           # soft overlong punishment
    c.dapo.overlong_buffer = 128      # L_buf in tokens
    c.dapo.overlong_factor = 1.0
    return c


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    paper: str
    apply: Callable[[ml_collections.ConfigDict], None]


def _grpo(c):
    c.kl.placement, c.kl.estimator, c.kl.beta = "loss", "k3", 0.04


def _ppo(c):
    c.advantage.estimator = "gae"
    c.advantage.baseline, c.advantage.scale = "none", "none"
    c.loss.norm = "token_mean"
    c.kl.placement, c.kl.estimator, c.kl.beta = "reward", "k1", 0.05


def _rloo(c):
    c.advantage.baseline, c.advantage.scale = "leave_one_out", "none"
    c.loss.norm, c.loss.type = "seq_mean_token_sum", "none"
    c.kl.placement, c.kl.estimator, c.kl.beta = "reward", "k1", 0.05


def _dr_grpo(c):
    c.advantage.scale = "none"
    c.loss.norm = "token_sum_norm"


def _dapo(c):
    c.loss.norm = "token_mean"
    c.loss.eps_low, c.loss.eps_high = 0.2, 0.28
    c.dapo.dynamic_sampling = True
    c.dapo.overlong = True


def _gspo(c):
    c.loss.norm, c.loss.type = "seq_mean", "sequence_clip"
    c.loss.eps_low, c.loss.eps_high = 3e-4, 4e-4


def _cispo(c):
    c.loss.norm, c.loss.type = "group_token_mean", "cispo"


def _gmpo(c):
    c.loss.norm, c.loss.type = "seq_mean", "gmpo"


def _sapo(c):
    c.loss.type = "sapo"


def _max_rl(c):
    # An advantage swap on any base recipe: divide by the group mean.
    c.advantage.scale = "group_mean"


_RECIPES = {r.name: r for r in [
    Recipe("ppo", "value critic + GAE, clipped ratio, KL in the reward",
           "Schulman et al. 2017; Ouyang et al. 2022", _ppo),
    Recipe("rloo", "leave-one-out baseline, one on-policy REINFORCE step",
           "Ahmadian et al. 2024", _rloo),
    Recipe("grpo", "group-normalized advantages, clip, k3 KL in the loss",
           "Shao et al. 2024 (DeepSeekMath)", _grpo),
    Recipe("dr_grpo", "GRPO without the std and with a constant normalizer",
           "Liu et al. 2025", _dr_grpo),
    Recipe("dapo", "clip-higher, token-mean loss, dynamic sampling, overlong",
           "Yu et al. 2025", _dapo),
    Recipe("gspo", "sequence-level ratio and clip", "Zheng et al. 2025 (Qwen)",
           _gspo),
    Recipe("cispo", "truncated, detached IS weight; every token keeps a gradient",
           "MiniMax-M1 2025", _cispo),
    Recipe("gmpo", "geometric mean of token ratios, clipped in log space",
           "Zhao et al. 2025", _gmpo),
    Recipe("sapo", "soft sigmoid gate instead of a hard clip",
           "Qwen 2025", _sapo),
    Recipe("max_rl", "group-mean scaled advantages on a base recipe (grpo)",
           "arXiv 2602.02710", _max_rl),
]}


def names() -> list[str]:
    """All recipe names, in the order of docs/algorithms.md §8."""
    return list(_RECIPES)


def describe(name: str) -> Recipe:
    if name not in _RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(_RECIPES)}")
    return _RECIPES[name]


def _parent(c: ml_collections.ConfigDict, key: str):
    """(section, leaf) of dotted `key`; ValueError naming a missing section."""
    *path, leaf = key.split(".")
    node = c
    for i, part in enumerate(path):
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            where = ".".join(path[:i]) or "config"
            raise ValueError(f"unknown config key {key!r}: {where} has no section "
                             f"{part!r}; valid: {', '.join(sorted(node.keys()))}")
        node = node[part]
    return node, leaf


def check_key(c: ml_collections.ConfigDict, key: str) -> None:
    """Raises ValueError unless dotted `key` names a field of `c`."""
    node, leaf = _parent(c, key)
    if leaf not in node:
        where = key.rpartition(".")[0] or "config"
        raise ValueError(f"unknown config key {key!r}; valid keys of {where}: "
                         f"{', '.join(sorted(node.keys()))}")


def _set(c: ml_collections.ConfigDict, key: str, value: Any) -> None:
    if isinstance(value, dict):
        _parent(c, key + ".x")  # the section itself must exist
        for k, v in value.items():
            _set(c, f"{key}.{k}", v)
        return
    check_key(c, key)
    node, leaf = _parent(c, key)
    try:
        node[leaf] = value
    except TypeError as e:
        raise ValueError(f"config key {key!r}: {e}") from None


def get(name: str, *, base: str | None = None, **overrides) -> ml_collections.ConfigDict:
    """The locked, validated config of recipe `name` with `overrides` applied.

    `base` only applies to `max_rl` (default `grpo`): MaxRL swaps the
    advantage scale of any base recipe.
    """
    recipe = describe(name)
    c = _base()
    if name == "max_rl":
        base = base or "grpo"
        if base == "max_rl":
            raise ValueError("max_rl base must be another recipe")
        describe(base).apply(c)
    elif base is not None:
        raise ValueError(f"base={base!r} only applies to recipe 'max_rl'")
    recipe.apply(c)
    c.recipe = name
    c.lock()
    for k, v in overrides.items():
        _set(c, k, v)
    validate(c)
    return c


def apply_overrides(c: ml_collections.ConfigDict, **overrides) -> ml_collections.ConfigDict:
    """Sets dotted or nested keys on a locked config, with named errors."""
    for k, v in overrides.items():
        _set(c, k, v)
    return c


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Rejects unknown choices and impossible combinations, naming the key."""
    from rljax._checks import check_choice
    a, l, o, k, d = c.advantage, c.loss, c.offpolicy, c.kl, c.dapo
    check_choice("advantage.estimator", a.estimator, ESTIMATORS)
    check_choice("advantage.baseline", a.baseline, adv_lib.BASELINES)
    check_choice("advantage.scale", a.scale, adv_lib.SCALES)
    check_choice("loss.norm", l.norm, normalizers.MODES)
    check_choice("loss.type", l.type, surrogates.TYPES)
    check_choice("offpolicy.level", o.level, offpolicy.LEVELS)
    check_choice("offpolicy.mode", o.mode, offpolicy.MODES)
    check_choice("kl.placement", k.placement, kl_lib.PLACEMENTS)
    check_choice("kl.estimator", k.estimator, kl_lib.ESTIMATORS)

    _need(c.group_size >= 1, f"group_size={c.group_size} must be >= 1")
    _need(c.max_tokens >= 1, f"max_tokens={c.max_tokens} must be >= 1")
    if a.estimator == "group":
        _need(not (a.baseline == "leave_one_out" and c.group_size < 2),
              "advantage.baseline='leave_one_out' needs group_size >= 2 "
              f"(got {c.group_size}); use baseline 'group_mean' or 'none'")
        _need(not (a.scale == "group_std" and c.group_size - a.ddof <= 0),
              f"advantage.scale='group_std' with ddof={a.ddof} needs group_size > "
              f"ddof (got {c.group_size})")
        _need(a.ddof in (0, 1), f"advantage.ddof={a.ddof} must be 0 or 1")
    _need(a.eps >= 0, f"advantage.eps={a.eps} must be >= 0")
    _need(0 <= a.gamma <= 1, f"advantage.gamma={a.gamma} must be in [0, 1]")
    _need(0 <= a.lam <= 1, f"advantage.lam={a.lam} must be in [0, 1]")

    seq_level = l.type in surrogates.SEQUENCE_LEVEL
    _need(not seq_level or l.norm == "seq_mean",
          f"loss.type={l.type!r} is a sequence-level trust region; it needs "
          f"loss.norm='seq_mean' (got {l.norm!r})")
    _need(l.norm != "seq_mean" or l.type in surrogates.SEQUENCE_LEVEL
          + ("sequence_clip_token",),
          f"loss.norm='seq_mean' aggregates one term per row; it needs loss.type "
          f"in {surrogates.SEQUENCE_LEVEL + ('sequence_clip_token',)} (got {l.type!r})")
    _need(0 <= l.eps_low < 1, f"loss.eps_low={l.eps_low} must be in [0, 1)")
    _need(l.eps_high >= 0, f"loss.eps_high={l.eps_high} must be >= 0")
    _need(l.dual_clip == 0 or l.dual_clip > 1,
          f"loss.dual_clip={l.dual_clip} must be 0 (off) or > 1")
    _need(0 <= l.cispo_min < l.cispo_max,
          f"loss.cispo_min={l.cispo_min} and loss.cispo_max={l.cispo_max} need "
          "0 <= min < max")
    _need(l.gmpo_delta > 0, f"loss.gmpo_delta={l.gmpo_delta} must be > 0")
    _need(l.sapo_tau_pos > 0 and l.sapo_tau_neg > 0,
          "loss.sapo_tau_pos and loss.sapo_tau_neg must be > 0")
    _need(0 < l.prob_eps <= 1, f"loss.prob_eps={l.prob_eps} must be in (0, 1]")
    _need(0 < l.ratio_low < l.ratio_high,
          f"loss.ratio_low={l.ratio_low}, loss.ratio_high={l.ratio_high} need "
          "0 < low < high")

    _need(o.epochs >= 1 and o.minibatches >= 1,
          "offpolicy.epochs and offpolicy.minibatches must be >= 1")
    _need(not (l.type == "none" and o.epochs * o.minibatches > 1),
          "loss.type='none' has no trust region: with offpolicy.epochs * "
          "offpolicy.minibatches > 1 later steps are off-policy; use 'clip'")
    _need(o.level == "none" or o.recompute_old_logp,
          f"offpolicy.level={o.level!r} corrects pi_old/mu, but pi_old := mu "
          "unless offpolicy.recompute_old_logp=True")
    _need(o.cap > 0, f"offpolicy.cap={o.cap} must be > 0")
    _need(0 < o.low < o.high, "offpolicy.low and offpolicy.high need 0 < low < high")
    _need(o.max_staleness >= 0, f"offpolicy.max_staleness={o.max_staleness} must be >= 0")

    _need(k.beta >= 0, f"kl.beta={k.beta} must be >= 0")
    _need(k.placement == "none" or k.beta > 0,
          f"kl.placement={k.placement!r} with kl.beta=0 does nothing; set "
          "kl.beta > 0 or kl.placement='none'")

    _need(not (d.dynamic_sampling and a.estimator != "group"),
          "dapo.dynamic_sampling filters groups; it needs advantage.estimator='group'")
    _need(d.max_sampling_rounds >= 1, "dapo.max_sampling_rounds must be >= 1")
    _need(not d.overlong or 0 < d.overlong_buffer <= c.max_tokens,
          f"dapo.overlong_buffer={d.overlong_buffer} must be in (0, max_tokens="
          f"{c.max_tokens}]")
    return c


def axes_row(c: ml_collections.ConfigDict) -> dict:
    """The five axes of a config, as short strings (the recipe table)."""
    a, l, k = c.advantage, c.loss, c.kl
    if a.estimator == "gae":
        adv = f"gae(gamma={a.gamma}, lam={a.lam})"
    else:
        adv = f"{a.baseline} / {a.scale}"
    tr = l.type
    if l.type in ("clip", "sequence_clip", "sequence_clip_token"):
        tr += (f" {l.eps_low:g}" if l.eps_low == l.eps_high
               else f" {l.eps_low:g}/{l.eps_high:g}")
    elif l.type == "gmpo":
        tr += f" {l.gmpo_delta:g}"
    elif l.type == "sapo":
        tr += f" {l.sapo_tau_pos:g}/{l.sapo_tau_neg:g}"
    elif l.type == "cispo":
        tr += f" max {l.cispo_max:g}"
    kl = "none" if k.placement == "none" else f"{k.placement}, {k.estimator}, {k.beta:g}"
    off = "pi_old=mu" if not c.offpolicy.recompute_old_logp else c.offpolicy.level
    return {"advantage": adv, "normalization": l.norm, "trust region": tr,
            "off-policy": off, "KL": kl}


def table() -> str:
    """A markdown table of every recipe's axes, built from the registry."""
    cols = ["recipe", "advantage", "normalization", "trust region", "off-policy",
            "KL", "paper"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name in names():
        row = {"recipe": name, **axes_row(get(name)), "paper": describe(name).paper}
        lines.append("| " + " | ".join(str(row[c]) for c in cols) + " |")
    return "\n".join(lines)
