"""Collection without a model: a Run built by hand around a scripted sampler.

`collect` reads only the Run's config, tokenizer, sources and sampler, so the
layout of a mixed rollout (allocation over sources, reference rows, hint
prompts, dynamic sampling) is checked exactly, in milliseconds.
"""

import pathlib
import runpy

import numpy as np

from rljax import objective
from rljax import recipes
from rljax.sampling import Completion
from rljax.train import build
from rljax.train import collect
from rljax.train import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


class ScriptedSampler:
    """`answer(prompt_text, j) -> completion text` for sample j of each prompt."""

    version = 0

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer = tokenizer, answer
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.n, params.seed))
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            for j in range(params.n):
                ids = self.tokenizer.encode(self.answer(text, j))[:params.max_new_tokens - 1]
                ids = ids + [self.tokenizer.eos_token_id]
                out.append(Completion(prompt_ids=list(p), completion_ids=ids,
                                      logprobs=[-0.5] * len(ids), finish_reason="stop",
                                      version=self.version))
        return out


def _run(config, answer):
    sources = build.resolve_sources(config)
    task = build.build_task(config)
    tokenizer = build.preset_tokenizer([s.task for s in sources] + [task])
    return build.Run(config=config, tokenizer=tokenizer, sources=sources, task=task,
                     sampler=ScriptedSampler(tokenizer, answer),
                     objective=objective.Objective.from_config(
                         config, sources=tuple(s.spec for s in sources)))


def _toy(recipe="grpo", **overrides):
    c = runpy.run_path(str(ROOT / "configs" / "toy.py"))["get_config"](recipe)
    recipes.apply_overrides(c, **overrides)
    return c


def _copy(text, j):
    """Sample 0 copies the string; sample 1 copies it backwards."""
    s = text.rstrip("=")
    return s if j == 0 else s[::-1]


def test_a_mixed_rollout_is_laid_out_by_source():
    c = _toy(**{"group_size": 2, "rollout.prompts_per_step": 4})
    args = dict(c.task.args)
    with c.sources.unlocked():
        c.sources.copy = config_lib.source("toy_copy", weight=1, args=args)
        c.sources.hint = config_lib.source("toy_copy", weight=1, algorithm="opsd", args=args,
                                           hint="{answer}=")
        c.sources.ref = config_lib.source("toy_copy", weight=2, algorithm="sft", args=args)
    config_lib.validate(c)
    run = _run(c, _copy)
    ro = collect.collect(run, 0, seed=7, version=3)
    tok, task = run.tokenizer, run.sources[0].task
    # Largest-remainder split of 4 groups by (1, 1, 2), sources sorted by name.
    np.testing.assert_array_equal(ro.source_B, [0, 0, 1, 1, 2, 2, 2, 2])
    assert [s.spec.component for s in run.sources] == ["rl", "ref_kl", "ce"]
    assert ro.data_pos == {"copy": 1, "hint": 1, "ref": 4}  # sft rows: one example each
    np.testing.assert_array_equal(ro.episode_B, np.arange(8))
    assert ro.active_B.all() and ro.env_mask_BxT is None and ro.token_rewards_BxT is None
    for b in range(8):
        ex = task.train_example([0, 0, 0, 0, 0, 1, 2, 3][b])
        prompt = tok.encode(ex.prompt)
        assert ro.prompt_len_B[b] == len(prompt)
        np.testing.assert_array_equal(ro.tokens_BxT[b, :len(prompt)], prompt)
        target = ex.answer if b >= 4 or b % 2 == 0 else ex.answer[::-1]
        completion = tok.encode(target) + [tok.eos_token_id]
        got = ro.tokens_BxT[b][ro.loss_mask_BxT[b] > 0]
        np.testing.assert_array_equal(got, completion)
        assert ro.texts[b] == target
        # Reference rows record no behavior log-probs; sampled rows the sampler's.
        want_lp = 0.0 if b >= 4 else -0.5
        np.testing.assert_array_equal(ro.behavior_logp_BxT[b][ro.loss_mask_BxT[b] > 0], want_lp)
        assert ro.rewards_B[b] == task.reward(target, ex)
        # Only the opsd rows carry a teacher prompt: the hint with the answer.
        hint = ro.teacher_prompts[b]
        assert (hint == tok.encode(ex.answer + "=")) if b in (2, 3) else hint is None
    np.testing.assert_array_equal(ro.version_B[:4], 0)   # the sampler's version
    np.testing.assert_array_equal(ro.version_B[4:], 3)   # reference rows: the trainer's
    # One generate call per sampled source, n samples per prompt.
    assert [call[:2] for call in run.sampler.calls] == [(1, 2), (1, 2)]


def test_dynamic_sampling_keeps_informative_groups_within_the_round_bound():
    def answer(text, j):
        # Even-length prompts: both samples right (all-equal rewards, no signal).
        return _copy(text, 0) if len(text) % 2 == 0 else _copy(text, j)

    c = _toy("dapo", **{"group_size": 2, "rollout.prompts_per_step": 3,
                        "dapo.overlong": False, "dapo.max_sampling_rounds": 3})
    run = _run(c, answer)
    ro = collect.collect(run, 0, seed=0, version=0)
    task = run.sources[0].task
    # Replay the rule: rounds of 3 prompts until 3 informative ones or 3 rounds.
    informative, filtered, pos, rounds = [], 0, 0, 0
    while len(informative) < 3 and rounds < 3:
        rounds += 1
        for _ in range(3):
            ex = task.train_example(pos)
            pos += 1
            if len(ex.prompt) % 2 and ex.answer != ex.answer[::-1]:
                informative.append(ex)
            else:
                filtered += 1
    assert ro.stats["filtered_groups"] == filtered > 0
    assert ro.stats["sampling_rounds"] == rounds and ro.data_pos["main"] == pos
    kept = min(len(informative), 3)
    assert ro.stats["dynamic_sampling_shortfall"] == 3 - kept
    act_G = ro.active_B.reshape(-1, 2)[:, 0]
    assert act_G.sum() == kept
    r_G = ro.rewards_B.reshape(-1, 2)
    assert all(np.ptp(g) > 0 for g in r_G[act_G])   # every trained group has signal
    prompts = [run.tokenizer.decode(ro.tokens_BxT[2 * g, :ro.prompt_len_B[2 * g]])
               for g in range(kept)]
    assert prompts == [ex.prompt for ex in informative[:kept]]


def test_allocation_is_a_largest_remainder_split():
    assert collect.allocate([1, 1, 2], 4) == [1, 1, 2]
    assert collect.allocate([1, 1, 1], 4) == [2, 1, 1]
    assert collect.allocate([0.001, 1, 1], 8) == [0, 4, 4]
    assert sum(collect.allocate([0.3, 0.3, 0.4], 7)) == 7
