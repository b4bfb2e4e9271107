"""Run + data position + seed -> one step's `Rollout`: render, sample, score.

Free functions over a `build.Run` (only its config, tokenizer, sources,
sampler and lock are read, so a Run built by hand with a scripted sampler
exercises all of this without a model). A step's `prompts_per_step` groups
are split over the sources by their shares; each source's `produce` makes
its groups: sampled (single-turn, or whole multi-turn episodes) and
resampled while dynamic sampling asks for informative ones, or taken from
the task's reference answers. They are scored, padded into one Rollout, and
rows the sampler got wrong are dropped (counted).
"""

import logging
import time
from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from rljax import shaping
from rljax.batch import Rollout
from rljax.train import multiturn
from rljax.train import rows as rows_lib
from rljax.train.rows import Row

log = logging.getLogger("rljax.train")


class Group(NamedTuple):
    """One prompt's rows, scored.

    rows: the group's `group_size` rows. rewards_N: their rewards. texts: the
    completions' text. continuation: (j, row) rows that continue row j's
    episode after a multi-turn prefix break. teacher_prompt: the rendered
    hint prompt its rows' teacher sees (opsd), or None.
    """

    rows: list
    rewards_N: np.ndarray
    texts: list
    continuation: tuple = ()
    teacher_prompt: Optional[list] = None


def allocate(weights, total: int) -> list[int]:
    """Largest-remainder split of `total` groups by `weights` (sums to total)."""
    w = np.asarray(weights, float) / np.sum(weights)
    raw = w * total
    out = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - out))[:total - out.sum()]:
        out[i] += 1
    return out.tolist()


def render_messages(run, messages) -> list[int]:
    """Chat messages -> prompt ids, with the config's system prompt if it sets one."""
    if run.config.task.system_prompt:
        messages = [{"role": "system", "content": run.config.task.system_prompt}] + [
            m for m in messages if m["role"] != "system"]
    text = run.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return run.tokenizer.encode(text)


def render(run, example, task) -> list[int]:
    return render_messages(run, task.messages(example))


def render_hint(run, source, example) -> list[int]:
    """The teacher's prompt: the last user message replaced by the source's hint."""
    messages = [dict(m) for m in source.task.messages(example)]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last]["content"] = source.hint.format(prompt=example.prompt, answer=example.answer)
    return render_messages(run, messages)


def decode(run, ids) -> str:
    """The completion's text for the reward: only the final stop token is cut.

    Other special tokens stay in the text (skip_special_tokens=False): a
    policy that pads its answer with <pad>/<bos> must not get them for
    free. Ids outside the vocabulary come only from a broken sampler; the
    row is dropped later (bad_rows), the text just must not crash scoring.
    """
    ids = list(ids)
    if ids and ids[-1] in run.stop_ids:
        ids = ids[:-1]
    v = run.tokenizer.vocab_size
    return run.tokenizer.decode([i for i in ids if 0 <= i < v], skip_special_tokens=False)


def sampling_params(run, seed: int, n: int):
    from rljax.sampling import SamplingParams
    r = run.config.rollout
    return SamplingParams(max_new_tokens=run.config.max_tokens, temperature=r.temperature,
                          top_p=r.top_p, top_k=r.top_k, stop_token_ids=run.stop_ids,
                          n=n, seed=seed)


def generate(run, prompts, params):
    """The sampler, one caller at a time (the async producer and evaluation share it)."""
    with run.lock:
        return run.sampler.generate(prompts, params)


class _LockedSampler:
    def __init__(self, run):
        self.run = run

    def generate(self, prompts, params):
        return generate(self.run, prompts, params)


def next_examples(run, source, pos: int, count: int, stats: dict):
    """`count` examples of `source` from data position `pos` (long prompts skipped)."""
    examples, prompts = [], []
    while len(examples) < count:
        ex = source.task.train_example(pos)
        pos += 1
        ids = render(run, ex, source.task)
        if len(ids) > run.config.rollout.max_prompt_tokens:
            stats["skipped_prompts"] += 1
            continue
        examples.append(ex)
        prompts.append(ids)
    return examples, prompts, pos


def score(run, source, example, completions):
    """(rewards_N, texts): the task's reward, plus DAPO's overlong shaping if on."""
    c = run.config
    texts = [decode(run, cc.completion_ids) for cc in completions]
    rewards = np.array([source.task.reward(t, example) for t in texts], np.float32)
    if c.dapo.overlong:
        lens = np.array([len(cc.completion_ids) for cc in completions])
        rewards = rewards + np.asarray(shaping.overlong_penalty(
            lens, max_tokens=c.max_tokens, buffer=c.dapo.overlong_buffer,
            factor=c.dapo.overlong_factor))
    return rewards, texts


def run_episodes(run, task, examples, n: int, *, seed: int, version: int, greedy=False):
    """`n` multi-turn episodes per example through `run.sampler`: (episodes, stats)."""
    from rljax import envs
    c = run.config

    def params(turn):
        base = sampling_params(run, seed * 131 + turn, 1)
        return base.replace(temperature=0.0) if greedy else base

    return multiturn.run_episodes(
        examples=examples, n=n,
        make_env=lambda: envs.get_env(c.env.name, task, max_turns=c.env.max_turns,
                                      over_budget_reward=c.env.over_budget_reward,
                                      **c.env.args.to_dict()),
        render_messages=lambda m: render_messages(run, m), sampler=_LockedSampler(run),
        sampling_params=params, decode=lambda ids: decode(run, ids),
        token_budget=c.env.token_budget, max_row_tokens=c.env.max_row_tokens, version=version)


def sample_round(run, source, examples, prompts, *, seed: int, version: int, stats: dict,
                 episodes: list) -> list[Group]:
    """One sampled, scored group per example: single-turn rows or whole episodes."""
    n = run.config.group_size
    hints = [render_hint(run, source, ex) if source.hint else None for ex in examples]
    if not run.config.env.name:
        comps = generate(run, prompts, sampling_params(run, seed, n))
        ts = time.perf_counter()
        groups = []
        for gi, ex in enumerate(examples):
            group = comps[gi * n:(gi + 1) * n]
            rewards, texts = score(run, source, ex, group)
            groups.append(Group([Row.from_completion(cc) for cc in group], rewards, texts,
                                teacher_prompt=hints[gi]))
        stats["time_score"] += time.perf_counter() - ts
        return groups
    eps, ep_stats = run_episodes(run, source.task, examples, n, seed=seed, version=version)
    for k, v in ep_stats.items():
        stats[k] = stats.get(k, 0) + v
    episodes.extend(eps)
    groups = []
    for gi in range(len(examples)):
        group = eps[gi * n:(gi + 1) * n]
        # The last row is the group's row; rows closed by a prefix break
        # train too, with the episode's advantage.
        groups.append(Group(
            rows=[e.row for e in group],
            rewards_N=np.array([e.reward for e in group], np.float32),
            texts=[decode(run, [t for t, m in zip(e.row.tokens, e.row.sampled) if m])
                   for e in group],
            continuation=[(j, r) for j, e in enumerate(group) for r in e.closed_rows],
            teacher_prompt=hints[gi]))
    return groups


def sampled_groups(run, source, count: int, pos: int, *, seed: int, version: int,
                   stats: dict, episodes: list):
    """(groups, active, pos): `count` groups of `source` (DAPO: informative ones, bounded rounds)."""
    c = run.config
    kept, filler, rounds = [], [], 0
    while True:
        rounds += 1
        examples, prompts, pos = next_examples(run, source, pos, count, stats)
        groups = sample_round(run, source, examples, prompts, seed=seed * 1009 + rounds,
                              version=version, stats=stats, episodes=episodes)
        informative_G = np.ones(len(groups), bool)
        if source.dynamic_sampling:
            informative_G = np.asarray(shaping.informative_groups(
                jnp.asarray(np.concatenate([g.rewards_N for g in groups])),
                group_size=c.group_size))
        for g, informative in zip(groups, informative_G):
            if not informative:
                stats["filtered_groups"] += 1
                filler.append(g)
            else:
                kept.append(g)
        if (not source.dynamic_sampling or len(kept) >= count
                or rounds >= c.dapo.max_sampling_rounds):
            break
    stats["sampling_rounds"] = max(stats["sampling_rounds"], rounds)
    kept = kept[:count]
    short = count - len(kept)
    stats["dynamic_sampling_shortfall"] += short
    return kept + filler[:short], [True] * len(kept) + [False] * short, pos


def reference_groups(run, source, count: int, pos: int, *, seed: int, version: int,
                     stats: dict, episodes: list):
    """(groups, active, pos): rows of (prompt, reference answer + EOS), no sampling."""
    del seed, episodes  # nothing is sampled
    from rljax.sampling import Completion
    n = run.config.group_size
    examples, prompts, pos = next_examples(run, source, pos, count * n, stats)
    groups = []
    for gi in range(count):
        exs, ids = examples[gi * n:(gi + 1) * n], prompts[gi * n:(gi + 1) * n]
        rows, texts = [], []
        for ex, prompt in zip(exs, ids):
            target = run.tokenizer.encode(str(ex.answer))[:run.config.max_tokens - 1]
            target = target + list(run.stop_ids[:1])
            rows.append(Row.from_completion(Completion(
                prompt_ids=prompt, completion_ids=target, logprobs=[0.0] * len(target),
                finish_reason="stop", version=version)))
            texts.append(str(ex.answer))
        rewards = np.array([source.task.reward(t, ex) for t, ex in zip(texts, exs)], np.float32)
        groups.append(Group(rows, rewards, texts))
    return groups, [True] * count, pos


def collect(run, data_pos, *, seed: int, version: int) -> Rollout:
    """`prompts_per_step` groups split over the sources, as one Rollout.

    data_pos: source name -> next example index (an int: the same for all).
    version: the policy version now in the sampler (rows it made carry it).
    """
    c = run.config
    n = c.group_size
    stats = {"skipped_prompts": 0, "filtered_groups": 0, "sampling_rounds": 0,
             "dynamic_sampling_shortfall": 0, "time_score": 0.0}
    t0 = time.perf_counter()
    if isinstance(data_pos, int):
        data_pos = {src.name: data_pos for src in run.sources}
    data_pos = dict(data_pos)
    counts = allocate([s.share for s in run.sources], c.rollout.prompts_per_step)
    groups, active_G, source_G, episodes = [], [], [], []
    for si, (src, count) in enumerate(zip(run.sources, counts)):
        if count == 0:
            continue
        got, act, data_pos[src.name] = src.produce(
            run, src, count, data_pos[src.name], seed=seed * 31 + si, version=version,
            stats=stats, episodes=episodes)
        groups += got
        active_G += act
        source_G += [si] * len(got)
    rows = [r for g in groups for r in g.rows]
    rewards = np.concatenate([g.rewards_N for g in groups])
    texts = [t for g in groups for t in g.texts]
    source = list(np.repeat(source_G, n))
    hints = [g.teacher_prompt for g in groups for _ in range(n)]
    # Rows closed by a multi-turn prefix break follow the groups, padded to
    # whole pseudo-groups of n with inactive filler; each points at its episode.
    episode = list(range(len(rows)))
    continuation = [(gi * n + j, r) for gi, g in enumerate(groups) for j, r in g.continuation]
    stats["overflow_rows"] = len(continuation)
    if continuation:
        pad = (-len(continuation)) % n
        parents = [p for p, _ in continuation]
        rows += [r for _, r in continuation] + [Row.filler(run.pad_id, version)] * pad
        episode += parents + [-1] * pad
        rewards = np.concatenate([rewards, rewards[parents], np.zeros(pad, np.float32)])
        source += [source[p] for p in parents] + [0] * pad
        texts += [texts[p] for p in parents] + [""] * pad
        hints += [None] * (len(parents) + pad)
    episode = np.asarray(episode, np.int32)
    active = np.repeat(active_G, n)
    if len(episode) > len(active):
        # A continuation row trains only if its episode's group does.
        active = np.concatenate([active, episode[len(active):] >= 0])
        active[len(groups) * n:] &= active[np.maximum(episode[len(groups) * n:], 0)]
    rollout = rows_lib.to_rollout(
        rows, bucket=c.rollout.length_bucket, pad_id=run.pad_id, multiturn=bool(c.env.name),
        rewards_B=rewards, source_B=np.asarray(source, np.int32), episode_B=episode,
        active_B=active, texts=tuple(texts),
        teacher_prompts=tuple(hints) if any(h is not None for h in hints) else None)
    # A sampler that returns garbage (non-finite log-probs, ids outside the
    # vocabulary) loses those rows, counted, instead of poisoning the step.
    bad = rows_lib.bad_rows(rollout, run.tokenizer.vocab_size)
    if bad.any():
        log.warning("dropping %d rows with non-finite log-probs or invalid token ids "
                    "from the sampler", int(bad.sum()))
        rollout.tokens_BxT[bad] = run.pad_id
        rollout.behavior_logp_BxT[bad] = 0.0
        active = active & ~bad
    stats["bad_sampler_rows"] = int(bad.sum())
    if episodes:
        stats.update(multiturn.episode_metrics(episodes))
    stats["time_sample"] = time.perf_counter() - t0 - stats["time_score"]
    return rollout.replace(active_B=active, data_pos=data_pos, stats=stats)
