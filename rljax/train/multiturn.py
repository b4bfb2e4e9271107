"""Multi-turn episodes through the sampler: tools, environment tokens, one row each.

All episodes of a step advance in lockstep, one `generate` call per turn. A
row holds the whole conversation as long as each re-rendered prompt is an
exact token-level extension of the row so far (prompt + sampled turns): the
environment's tokens are then appended with `loss_mask = 0`, and the sampled
tokens keep the behavior log-probs the sampler recorded. When re-rendering
breaks the prefix (a chat template that re-tokenizes a reply differently),
the row is closed and a new row starts from the full new prompt; every row
of an episode shares its reward (counted in `prefix_breaks`).
"""

import dataclasses

import numpy as np

from rljax.train.rows import Row


@dataclasses.dataclass
class Episode:
    example: object
    env: object
    messages: list
    row: Row
    closed_rows: list = dataclasses.field(default_factory=list)
    turn_rewards: list = dataclasses.field(default_factory=list)
    done: bool = False
    turns: int = 0
    sampled_tokens: int = 0
    over_budget: bool = False
    infos: list = dataclasses.field(default_factory=list)

    @property
    def reward(self) -> float:
        return float(np.sum(self.turn_rewards)) if self.turn_rewards else 0.0


def _new_row(prompt_ids, version) -> Row:
    n = len(prompt_ids)
    return Row(tokens=list(prompt_ids), sampled=[0] * n, logp=[0.0] * n, env=[0] * n,
               rewards=[0.0] * n, truncated=False, version=version)


def run_episodes(*, examples, n, make_env, render_messages, sampler, sampling_params,
                 decode, token_budget: int, max_row_tokens: int, version: int):
    """Plays `n` episodes per example (prompt-major, the trainer's groups).

    make_env(example) -> Environment; render_messages(messages) -> token ids;
    sampling_params(turn) -> SamplingParams (n=1). Returns (episodes, stats).
    """
    episodes = []
    for ex in examples:
        for _ in range(n):
            env = make_env()
            messages = env.reset(ex)
            episodes.append(Episode(ex, env, messages, _new_row(render_messages(messages),
                                                                 version)))
    stats = {"prefix_breaks": 0, "over_budget_episodes": 0}
    turn = 0
    while True:
        live = [e for e in episodes if not e.done]
        if not live:
            break
        params = sampling_params(turn)
        comps = sampler.generate([e.row.tokens for e in live], params)
        for e, c in zip(live, comps):
            ids = list(c.completion_ids)
            e.row.tokens += ids
            e.row.sampled += [1] * len(ids)
            e.row.logp += list(c.logprobs)
            e.row.env += [0] * len(ids)
            e.row.rewards += [0.0] * len(ids)
            e.row.truncated = c.finish_reason == "length"
            e.row.version = c.version
            e.sampled_tokens += len(ids)
            e.turns += 1
            result = e.env.step(decode(ids))
            if not result.done and (e.sampled_tokens >= token_budget
                                    or len(e.row.tokens) >= max_row_tokens):
                result = e.env.end_over_budget()
                e.over_budget = True
                stats["over_budget_episodes"] += 1
            e.infos.append(result.info)
            e.turn_rewards.append(float(result.reward))
            if ids:  # the turn's reward sits on its last sampled token
                e.row.rewards[-1] += float(result.reward)
            if result.done:
                e.done = True
                continue
            e.messages = e.messages + [{"role": "assistant", "content": decode(ids)}] \
                + list(result.observation)
            prompt = render_messages(e.messages)
            cur = e.row.tokens
            if prompt[:len(cur)] == cur and len(prompt) > len(cur):
                env_ids = prompt[len(cur):]
                e.row.tokens += env_ids
                e.row.sampled += [0] * len(env_ids)
                e.row.logp += [0.0] * len(env_ids)
                e.row.env += [1] * len(env_ids)  # after the first reply: echo targets
                e.row.rewards += [0.0] * len(env_ids)
            else:
                stats["prefix_breaks"] += 1
                e.closed_rows.append(e.row)
                e.row = _new_row(prompt, version)
            if len(e.row.tokens) >= max_row_tokens:
                result = e.env.end_over_budget()
                e.over_budget = True
                stats["over_budget_episodes"] += 1
                e.turn_rewards.append(float(result.reward))
                e.done = True
        turn += 1
    return episodes, stats


def episode_metrics(episodes) -> dict:
    """Turns per episode, tool-call success rate, environment tokens per row."""
    calls = sum(1 for e in episodes for i in e.infos if i.get("tool_call"))
    ok = sum(1 for e in episodes for i in e.infos if i.get("tool_call") and i.get("tool_ok"))
    timeouts = sum(1 for e in episodes for i in e.infos if i.get("tool_timeout"))
    rows = [r for e in episodes for r in e.closed_rows + [e.row]]
    return {
        "turns_per_episode": float(np.mean([e.turns for e in episodes])),
        "tool_calls": calls,
        "tool_success_rate": ok / calls if calls else 0.0,
        "tool_timeouts": timeouts,
        "env_tokens_per_row": float(np.mean([sum(r.env) for r in rows])),
    }
