"""The trainer end to end on configs/toy.py: learning, resume, skips, DAPO, async."""

import dataclasses
import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import objective
from rljax import recipes
from rljax.train import build
from rljax.train import collect
from rljax.train import config as config_lib
from rljax.train import loop
from rljax.train import metrics as metrics_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def toy_config(recipe="grpo", **overrides):
    c = runpy.run_path(str(ROOT / "configs" / "toy.py"))["get_config"](recipe)
    recipes.apply_overrides(c, **overrides)
    return config_lib.validate(c)


@pytest.mark.slow
def test_toy_config_learns(tmp_path):
    """A learning test: held-out and training reward rise well above the start."""
    summary = loop.train(toy_config(), tmp_path)
    rows = [r for r in metrics_lib.read(tmp_path) if "reward_mean" in r]
    assert len(rows) == 150
    first = np.mean([r["reward_mean"] for r in rows[:10]])
    last = np.mean([r["reward_mean"] for r in rows[-20:]])
    # Random init copies ~1 character in 10; the trained policy far more.
    assert last > first + 0.1, (first, last)
    before = summary["eval_before"]["eval_reward"]
    after = summary["eval_after"]["eval_reward"]
    assert after > before + 0.2, summary
    for r in rows:
        assert r["skipped"] == 0 and r["mismatch_abs"] < 1e-4


def _run_cli(workdir, steps, *extra):
    return [sys.executable, "-m", "rljax.cli", "train", "--config", str(ROOT / "configs/toy.py"),
            "--workdir", str(workdir), f"--config.steps={steps}",
            "--config.train.checkpoint_every=3", *extra]


def test_killed_run_resumes_on_the_same_trajectory(tmp_path):
    """SIGKILL after step 4, resume: steps 4..6 equal an uninterrupted run."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    full = tmp_path / "full"
    subprocess.run(_run_cli(full, 6), check=True, env=env, cwd=ROOT,
                   capture_output=True, timeout=300)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_run_cli(killed, 6), env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    path = killed / "metrics.jsonl"
    try:
        while time.time() < deadline:
            steps = [json.loads(l)["step"] for l in path.read_text().splitlines()
                     if l.strip()] if path.exists() else []
            # Kill once step 5 is logged and step 3's checkpoint is final (orbax
            # renames it into place), so the resume has a checkpoint to start from
            # however slowly the asynchronous save runs on a loaded machine.
            if any(s >= 5 for s in steps) and (killed / "checkpoints" / "3").is_dir():
                break
            if proc.poll() is not None:
                pytest.fail("the run ended before it could be killed")
            time.sleep(0.05)
        else:
            pytest.fail("the run never reached step 5")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    out = subprocess.run(_run_cli(killed, 6), check=True, env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    summary = json.loads(out.stdout[:out.stdout.rindex("}") + 1])
    assert summary["start_step"] in (3, 6)  # from a checkpoint, not from scratch
    a = {r["step"]: r for r in metrics_lib.read(full) if "reward_mean" in r}
    b = {r["step"]: r for r in metrics_lib.read(killed) if "reward_mean" in r}
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # no step twice, none missing
    for s in range(1, 7):
        for key in ("reward_mean", "loss", "grad_norm", "entropy"):
            np.testing.assert_allclose(b[s][key], a[s][key], rtol=1e-5, atol=1e-7,
                                       err_msg=f"step {s} {key}")


def test_nonfinite_step_is_skipped_and_state_kept():
    config = toy_config()
    trainer = loop.Trainer.create(config, "/tmp/rljax-test-unused-" + str(os.getpid()))
    ro = trainer.collect(0, seed=1)
    before = jax.tree.map(np.asarray, trainer.state.params)
    # Poison the behavior log-probs after the rollout check, as a broken
    # numeric path would: the loss is NaN and the update must be skipped.
    ro.behavior_logp_BxT[:] = np.nan
    m = trainer.train_on(ro, 0)
    assert m["skipped"] == 1
    after = jax.tree.map(np.asarray, trainer.state.params)
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert int(trainer.state.step) == 0
    # A healthy batch then updates.
    m = trainer.train_on(trainer.collect(0, seed=1), 0)
    assert m["skipped"] == 0 and int(trainer.state.step) == 1
    trainer.checkpointer.close()


def test_garbage_from_the_sampler_is_dropped_and_counted(tmp_path):
    config = toy_config()
    trainer = loop.Trainer.create(config, tmp_path)
    real = trainer.run.sampler

    class Garbage:
        version = 0

        def generate(self, prompts, params):
            comps = real.generate(prompts, params)
            comps[0].logprobs[0] = float("nan")
            comps[1].completion_ids[0] = 10_000
            return comps

        def update_weights(self, state, version):
            real.update_weights(state, version)

    trainer.run = dataclasses.replace(trainer.run, sampler=Garbage())
    ro = trainer.collect(0, seed=0)
    assert ro.stats["bad_sampler_rows"] == 2
    assert not ro.active_B[0] and not ro.active_B[1] and ro.active_B[2:].all()
    m = trainer.train_on(ro, 0)
    assert m["skipped"] == 0 and np.isfinite(m["loss"])
    trainer.checkpointer.close()


def test_consecutive_skips_stop_the_run_with_state_saved(tmp_path):
    config = toy_config(steps=6, **{"train.max_consecutive_skips": 1})
    trainer = loop.Trainer.create(config, tmp_path)
    real_train_on = trainer.train_on

    def poisoned(ro, step):
        ro.behavior_logp_BxT[:] = np.nan
        return real_train_on(ro, step)

    trainer.train_on = poisoned
    with pytest.raises(RuntimeError, match="2 consecutive steps.*non-finite"):
        trainer.train()
    assert trainer.checkpointer.latest_step() == 2


def test_nan_rewards_are_counted_not_propagated(tmp_path):
    config = toy_config(**{"task.reward_fn": "tests.train.rewards_fixture:nan_reward"})
    trainer = loop.Trainer.create(config, tmp_path)
    m = trainer.train_on(trainer.collect(0, seed=0), 0)
    assert m["invalid_groups"] == config.rollout.prompts_per_step
    assert np.isfinite(m["loss"]) and m["loss"] == 0.0
    trainer.checkpointer.close()


def test_dapo_dynamic_sampling_keeps_informative_groups(tmp_path):
    # Overlong shaping off: its length penalty would give constant groups signal.
    config = toy_config("dapo", **{
        "task.reward_fn": "tests.train.rewards_fixture:constant_for_even_prompts",
        "dapo.overlong": False})
    assert config.dapo.dynamic_sampling
    trainer = loop.Trainer.create(config, tmp_path)
    ro = trainer.collect(0, seed=0)
    assert ro.stats["filtered_groups"] > 0
    n = config.group_size
    r = ro.rewards_B.reshape(-1, n)
    act = ro.active_B.reshape(-1, n)[:, 0]
    # Every active group carries signal; fillers (if any) are masked out.
    assert all(np.ptp(g) > 0 for g in r[act])
    assert ro.stats["dynamic_sampling_shortfall"] == int((~act).sum())
    assert ro.data_pos["main"] > config.rollout.prompts_per_step  # it sampled again
    trainer.checkpointer.close()


def test_async_generation_runs_ahead_within_staleness(tmp_path):
    config = toy_config(steps=5, **{"sampler.ahead": 2, "offpolicy.max_staleness": 1})
    summary = loop.train(config, tmp_path)
    rows = [r for r in metrics_lib.read(tmp_path) if "reward_mean" in r]
    assert len(rows) == 5 and "eval_reward" in summary["eval_after"]
    # Rows sampled more than one version ago were dropped and counted.
    for r in rows:
        if r["staleness"] > 1:
            assert r["stale_rows"] > 0
    assert any(r["staleness"] > 0 for r in rows)  # it really ran ahead


def test_train_step_guard_in_isolation():
    """The jitted step alone: NaN loss -> same params, skipped=1, no recompile."""
    config = toy_config()
    trainer = loop.Trainer.create(config, "/tmp/rljax-test-guard-" + str(os.getpid()))
    ro = trainer.collect(0, seed=3)
    trainer.train_on(ro, 0)
    step = trainer.run.programs.train_step
    size = step._cache_size()
    trainer.train_on(trainer.collect(100, seed=4), 1)
    assert step._cache_size() == size  # same bucket: no recompile
    trainer.checkpointer.close()


def test_ppo_trains_a_critic_alongside(tmp_path):
    # The toy turns KL off; put PPO's KL-in-reward back to exercise the reference.
    config = toy_config("ppo", **{"kl.placement": "reward", "kl.beta": 0.05})
    assert config.advantage.estimator == "gae" and config.kl.placement == "reward"
    trainer = loop.Trainer.create(config, tmp_path)
    critic0 = jax.tree.map(np.asarray, trainer.state.critic_params)
    ro = trainer.collect(0, seed=0)
    m = trainer.train_on(ro, 0)
    assert m["skipped"] == 0 and m["value_loss"] > 0
    critic1 = jax.tree.map(np.asarray, trainer.state.critic_params)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()),
                                         critic0, critic1))
    assert max(moved) > 0  # the critic was updated
    # Values sit on the token grid: V[:, 0] is the empty prefix's 0.
    tokens = jnp.asarray(ro.tokens_BxT)
    v = trainer.run.programs.value_fn(trainer.state.critic_params, tokens,
                                      jnp.asarray(ro.positions_BxT))
    np.testing.assert_array_equal(np.asarray(v)[:, 0], 0.0)
    trainer.checkpointer.close()


def test_mixed_sources_feed_each_component(tmp_path):
    """grpo + rloo + sft + opd sources in one batch; the loss reads only streams."""
    teacher_cfg = toy_config(seed=1)
    teacher = loop.Trainer.create(teacher_cfg, tmp_path / "teacher")
    teacher.save(0, wait=True)  # a different init serves as the teacher
    teacher.checkpointer.close()

    c = toy_config(**{"rollout.prompts_per_step": 8})
    with c.sources.unlocked():
        c.sources.copy = config_lib.source("toy_copy", weight=2, algorithm="grpo",
                                           args=dict(c.task.args))
        c.sources.rev = config_lib.source("toy_reverse", weight=2, algorithm="rloo",
                                          args=dict(c.task.args))
        c.sources.sft = config_lib.source("toy_copy", weight=2, algorithm="sft",
                                          args=dict(c.task.args))
        c.sources.opd = config_lib.source("toy_copy", weight=2, algorithm="opd",
                                          args=dict(c.task.args),
                                          teacher=str(tmp_path / "teacher"))
    config_lib.validate(c)
    trainer = loop.Trainer.create(c, tmp_path / "student")
    run = trainer.run
    assert [s.name for s in run.sources] == ["copy", "opd", "rev", "sft"]
    ro = trainer.collect(trainer.data_pos, seed=0)
    n = c.group_size
    # Two groups of each source, in source order.
    np.testing.assert_array_equal(ro.source_B, np.repeat([0, 0, 1, 1, 2, 2, 3, 3], n))
    components = [run.sources[i].spec.component for i in ro.source_B[::n]]
    assert components == ["rl", "rl", "ref_kl", "ref_kl", "rl", "rl", "ce", "ce"]
    # sft rows carry the reference answer + EOS as their completion.
    sft_row = 6 * n
    answer = ro.texts[sft_row]
    ids = ro.tokens_BxT[sft_row][ro.loss_mask_BxT[sft_row] > 0]
    assert run.tokenizer.decode(ids.tolist()) == answer
    streams = objective.token_streams(run.objective, ro, run.logprobs(trainer.state, ro),
                                      version=trainer.version)
    # rloo rows: leave-one-out advantages of their own rewards, unscaled.
    r = ro.rewards_B[4 * n:5 * n]
    loo = r - (r.sum() - r) / (n - 1)
    rows = np.arange(4 * n, 5 * n)
    m = np.asarray(streams.rl_mask_BxT)[rows]
    got = np.asarray(streams.advantages_BxT)[rows]
    for i in range(n):
        if m[i].any() and np.ptp(r) > 0:
            np.testing.assert_allclose(got[i][m[i] > 0], loo[i], rtol=1e-5, atol=1e-6)
    # Component masks are disjoint: rl on 0/2, ref_kl on opd, ce on sft.
    assert np.all(np.asarray(streams.rl_mask_BxT)[2 * n:4 * n] == 0)
    assert np.all(np.asarray(streams.ref_kl_weights_BxT)[:2 * n] == 0)
    assert np.asarray(streams.ce_weights_BxT)[6 * n:].sum() > 0
    met = trainer.train_on(ro, 0)
    assert met["skipped"] == 0
    assert met["loss_ce"] > 0            # -mean logp of the targets
    assert met["loss_ref_kl"] != 0.0     # teacher and student differ
    assert np.isfinite(met["loss_rl"])
    trainer.checkpointer.close()


def multiturn_config(recipe="grpo", **overrides):
    c = runpy.run_path(str(ROOT / "configs" / "toy_multiturn.py"))["get_config"](recipe)
    recipes.apply_overrides(c, **overrides)
    return config_lib.validate(c)


def test_multiturn_rows_keep_sampled_logprobs_and_mask_env_tokens(tmp_path):
    config = multiturn_config(**{"env.echo_weight": 0.1})
    trainer = loop.Trainer.create(config, tmp_path)
    run = trainer.run
    ro = trainer.collect(trainer.data_pos, seed=0)
    assert ro.stats["prefix_breaks"] == 0 and ro.stats["overflow_rows"] == 0
    assert ro.stats["turns_per_episode"] == 2.0
    assert ro.shape[0] == config.rollout.prompts_per_step * config.group_size
    eos = run.tokenizer.eos_token_id
    for i in range(ro.shape[0]):
        ids = ro.tokens_BxT[i]
        sampled = ro.loss_mask_BxT[i] > 0
        env = ro.env_mask_BxT[i] > 0
        # prompt | answer 1 (+EOS) | repeated prompt (env) | answer 2
        prompt = collect.render(run, run.task.train_example(i // config.group_size), run.task)
        np.testing.assert_array_equal(ids[:len(prompt)], prompt)
        assert env.any()  # every episode has two turns, so env tokens between them
        start = int(np.nonzero(env)[0][0])
        answer1 = ids[len(prompt):start][sampled[len(prompt):start]]
        assert len(answer1) > 0 and np.all(~sampled[env])
        # The env repeats the prompt; a first answer cut by the token limit is
        # closed by the template's <eos>, which is then an environment token.
        want = list(prompt) if answer1[-1] == eos else [eos] + list(prompt)
        np.testing.assert_array_equal(ids[env], want)
    # The trainer's log-probs of sampled tokens, in context, are what the sampler recorded.
    logp, _ = run.programs.logprob_fn(trainer.state.params, jnp.asarray(ro.tokens_BxT),
                                      jnp.asarray(ro.positions_BxT))
    m = ro.loss_mask_BxT > 0
    np.testing.assert_allclose(np.asarray(logp)[m], ro.behavior_logp_BxT[m], atol=1e-4)
    met = trainer.train_on(ro, 0)
    assert met["skipped"] == 0 and met["loss_ce"] > 0  # echo on env tokens
    trainer.checkpointer.close()


@pytest.mark.slow
def test_toy_multiturn_learns(tmp_path):
    summary = loop.train(multiturn_config(), tmp_path)
    rows = [r for r in metrics_lib.read(tmp_path) if "reward_mean" in r]
    first = np.mean([r["reward_mean"] for r in rows[:10]])
    last = np.mean([r["reward_mean"] for r in rows[-20:]])
    assert last > first + 0.1, (first, last)
    assert summary["eval_after"]["eval_reward"] > summary["eval_before"]["eval_reward"] + 0.15
    assert all(r["turns_per_episode"] == 2.0 for r in rows)


def test_remote_sampler_is_built_with_a_sync_dir(tmp_path):
    """sampler.kind=remote: weights travel through <workdir>/sampler_sync by default."""
    from rljax import sampling
    config = toy_config(**{"sampler.kind": "remote", "sampler.url": "http://127.0.0.1:9"})
    s = build.build_sampler(config, None, sync_dir=str(tmp_path / "sync"))
    assert isinstance(s, sampling.RemoteSampler)
    assert str(s.sync_dir) == str(tmp_path / "sync")
    with pytest.raises(ValueError, match="sampler.url"):
        toy_config(**{"sampler.kind": "remote"})
