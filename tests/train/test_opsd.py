"""opsd, on-policy self-distillation: a new per-source algorithm with no trainer change.

The teacher is the live policy prompted with a hint the student never sees.
On the toy, the student answers reverse prompts `s#` (answer: s reversed);
the hint `{answer}=` shows the teacher a *copy* prompt of that answer, which
the same policy learns to answer from grpo (and sft) rows on copy prompts
`s=`. So the reverse rows, which never see a reward, can only learn through
the `ref_kl` stream `sg(logp_teacher_with_hint - logp_student)`
(docs/algorithms.md §9).
"""

import pathlib
import runpy

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

import rljax
from rljax import recipes
from rljax.train import build
from rljax.train import config as config_lib
from rljax.train import loop
from rljax.train import metrics as metrics_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGS = dict(alphabet="abcd", min_len=2, max_len=4)
REVERSE = dict(ARGS, separator="#")


# Held-out greedy reward on the reverse prompts after the learning run below
# with `control=True`: the reverse rows then train nothing (an sft source of
# weight 0), so what remains is what copying alone transfers. Measured with
# `opsd_config(steps=80, control=True)` (the report has the command).
CONTROL_EVAL = 0.19


def opsd_config(steps=1, control=False, **overrides):
    c = runpy.run_path(str(ROOT / "configs" / "toy.py"))["get_config"]()
    recipes.apply_overrides(c, steps=steps, **{"task.name": "toy_reverse", **overrides})
    c.task.args = ml_collections.ConfigDict(REVERSE)  # held-out: the reverse prompts
    with c.sources.unlocked():
        c.sources.copy = config_lib.source("toy_copy", weight=1, algorithm="grpo", args=ARGS)
        c.sources.demo = config_lib.source("toy_copy", weight=1, algorithm="sft", args=ARGS)
        c.sources.rev = (config_lib.source("toy_reverse", weight=2, algorithm="sft",
                                           args=REVERSE, ce_weight=0.0) if control else
                         config_lib.source("toy_reverse", weight=2, algorithm="opsd",
                                           args=REVERSE, hint="{answer}="))
    return config_lib.validate(c)


def _hand_logp(logits_fn, seq, start, temperature, width=16):
    """log softmax(logits / temperature) of seq[start:], from one forward pass.

    The row is right-padded to a fixed width (one compilation); the model is
    causal, so the padding after it changes nothing.
    """
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(seq)] = seq
    logp = jax.nn.log_softmax(np.asarray(logits_fn(tokens))[0] / temperature, axis=-1)
    return np.array([float(logp[t - 1, seq[t]]) for t in range(start, len(seq))])


@pytest.mark.slow
def test_opsd_signal_mixes_with_grpo_rows_and_learns(tmp_path):
    """The first step's signal by hand; then the run learns reverse from its hinted self."""
    config = opsd_config(steps=80, **{"task.eval_size": 24})
    trainer = loop.Trainer.create(config, tmp_path)
    run, tok = trainer.run, trainer.run.tokenizer
    assert [(s.name, s.spec.component, s.teacher_kind) for s in run.sources] == [
        ("copy", "rl", ""), ("demo", "ce", ""), ("rev", "ref_kl", "self")]
    n = config.group_size
    # The rollout the first training step will see (same data position and seed).
    ro = trainer.collect(trainer.data_pos, loop.sampling_seed(config, 0))
    opsd_rows = np.flatnonzero(ro.source_B == 2)
    assert opsd_rows.size == 4 * n
    lp = run.logprobs(trainer.state, ro)
    student = np.asarray(run.programs.logprob_fn(trainer.state.params, ro.tokens_BxT,
                                                 ro.positions_BxT)[0])
    streams = rljax.token_streams(run.objective, ro, lp, version=trainer.version)
    batch = rljax.train_batch(run.objective, streams, np.arange(ro.shape[0]))
    w = np.asarray(rljax.rollout_token_weights(run.objective, ro, student, lp, version=0))
    # The policy's own logits, computed here for the hand computation.
    graphdef, _ = nnx.split(build.build_policy(config, [s.task for s in run.sources]
                                               + [run.task])[0])
    params = trainer.state.params
    logits_fn = jax.jit(lambda x: nnx.merge(graphdef, params)(x).logits)
    temperature = config.rollout.temperature
    task = run.sources[2].task
    for i, b in enumerate(opsd_rows):
        ex = task.train_example(i // n)
        p = int(ro.prompt_len_B[b])
        completion = ro.tokens_BxT[b][ro.loss_mask_BxT[b] > 0].tolist()
        assert ro.tokens_BxT[b, :p].tolist() == tok.encode(ex.prompt)     # "s#": no hint
        hint = tok.encode(ex.answer + "=")
        assert list(ro.teacher_prompts[b]) == hint
        teacher_hand = _hand_logp(logits_fn, hint + completion, len(hint), temperature)
        student_hand = _hand_logp(logits_fn, tok.encode(ex.prompt) + completion, p, temperature)
        cols = np.arange(p, p + len(completion))
        np.testing.assert_allclose(np.asarray(lp.teacher_logp_BxT)[b, cols], teacher_hand,
                                   atol=2e-5)
        np.testing.assert_allclose(student[b, cols], student_hand, atol=2e-5)
        # seq_mean_token_mean over the opsd rows: c = 1 / (B' L_b); the token
        # weight is c * sg(teacher - student).
        np.testing.assert_allclose(w[b, cols], (teacher_hand - student_hand)
                                   / (len(opsd_rows) * len(completion)), rtol=1e-4, atol=1e-7)
        assert np.all(w[b][ro.loss_mask_BxT[b] == 0] == 0.0)
        assert not np.allclose(teacher_hand, student_hand)  # the hint changes the teacher
    # Mixed with grpo rows in the same step: disjoint components, each its own coefficients.
    grpo_rows = np.flatnonzero(ro.source_B == 0)
    assert np.all(np.asarray(streams.rl_mask_BxT)[opsd_rows] == 0)
    assert np.all(np.asarray(streams.ref_kl_weights_BxT)[grpo_rows] == 0)
    adv = np.asarray(streams.advantages_BxT)
    np.testing.assert_allclose(w[grpo_rows], adv[grpo_rows] * np.asarray(batch.coef)[grpo_rows],
                               rtol=1e-3, atol=1e-7)
    assert np.count_nonzero(w[grpo_rows]) > 0
    summary = trainer.train()
    rows = [r for r in metrics_lib.read(tmp_path) if "reward_mean" in r]
    # Step 1 trained on this rollout: its ref_kl loss is the k1 value sum c (student - teacher).
    k1 = np.sum(np.asarray(batch.ref_kl_coef) * (student - np.asarray(lp.teacher_logp_BxT)))
    np.testing.assert_allclose(rows[0]["loss_ref_kl"], k1, rtol=1e-4)
    first = np.mean([r["reward_mean/rev"] for r in rows[:10]])
    last = np.mean([r["reward_mean/rev"] for r in rows[-10:]])
    # The reverse rows never see a reward, yet their reward rises.
    assert last > first + 0.15, (first, last)
    before = summary["eval_before"]["eval_reward"]
    after = summary["eval_after"]["eval_reward"]
    # Held-out reverse prompts (greedy). The same run with the reverse rows
    # untrained reaches CONTROL_EVAL from copying alone; learning through the
    # hinted teacher goes well past it.
    assert after > max(before, CONTROL_EVAL) + 0.1, summary


@pytest.mark.parametrize("source,env,match", [
    (dict(algorithm="opsd", hint="{solution}"), "", r"sources.rev.hint=.*\{answer\}.*unknown: \['solution'\]"),
    (dict(algorithm="opsd", hint="no answer here"), "", r"must use \{answer\}"),
    (dict(algorithm="opsd", hint="{answer"), "", "not a format string"),
    (dict(algorithm="grpo", hint="{answer}="), "", "read only by algorithm='opsd'"),
    (dict(algorithm="opsd", teacher="runs/x"), "", "teacher is read only by algorithm='opd'"),
    (dict(algorithm="opsd"), "toy_multiturn", "single-turn rows"),
])
def test_opsd_source_is_validated_before_any_work(source, env, match):
    c = opsd_config()
    with c.sources.unlocked():
        c.sources.rev = config_lib.source("toy_reverse", args=REVERSE, **source)
    with c.env.unlocked():
        c.env.name = env
    with pytest.raises(ValueError, match=match):
        config_lib.validate(c)


def test_opsd_default_hint_shows_the_answer():
    s = config_lib.source("arithmetic", algorithm="opsd")
    assert s.hint == config_lib.DEFAULT_HINT
    assert s.hint.format(prompt="Compute 2 + 3.", answer=5).endswith("(A correct answer is: 5)")
