"""The inspection API is the trainer: token weights equal the trainer's own gradient.

A mixed rollout (grpo, echo, rloo and sft sources) of multi-turn rows on the
tiny model trains two minibatches, each split into two micro-batches, with
GRPO's k3 KL in the loss. For every optimizer step the trainer really took,
`rljax.rollout_token_weights` (built from the rollout alone) must be minus
the gradient of that step's loss with respect to each token's log-prob:

1. it equals `-d policy_loss / d logp` on the exact TrainBatch the trainer
   fed its jitted step (captured), at the parameters the step started from;
2. pulled back through the model (`J^T w`), it has the global norm of the
   parameter gradient the jitted step computed (its `grad_norm` metric, summed
   over micro-batches inside the step), and its loss value is the step's.
"""

import dataclasses
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rljax
from rljax import recipes
from rljax.train import config as config_lib
from rljax.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]


class RecordingStep:
    """Wraps the trainer's jitted step: keeps (params before, batch, metrics) of each call."""

    def __init__(self, step):
        self.step, self.calls = step, []

    def __call__(self, state, batch):
        params = jax.tree.map(jnp.copy, state.params)  # the step donates its state
        state, metrics = self.step(state, batch)
        self.calls.append((params, batch, jax.device_get(metrics)))
        return state, metrics

    def _cache_size(self):
        return self.step._cache_size()


def _config():
    c = runpy.run_path(str(ROOT / "configs" / "toy_multiturn.py"))["get_config"]()
    recipes.apply_overrides(c, **{
        "group_size": 4, "rollout.prompts_per_step": 8, "offpolicy.minibatches": 2,
        "train.micro_batches": 2, "kl.placement": "loss", "kl.beta": 0.04})
    args = dict(c.task.args)
    with c.sources.unlocked():
        c.sources.copy = config_lib.source("toy_copy", weight=1, algorithm="grpo", args=args)
        c.sources.echo = config_lib.source("toy_copy", weight=1, algorithm="echo", args=args)
        c.sources.rev = config_lib.source("toy_reverse", weight=1, algorithm="rloo", args=args)
        c.sources.sft = config_lib.source("toy_copy", weight=1, algorithm="sft", args=args)
    return config_lib.validate(c)


def test_token_weights_are_minus_the_trainers_gradient_in_every_minibatch(tmp_path):
    config = _config()
    trainer = loop.Trainer.create(config, tmp_path)
    run = trainer.run
    rollout = trainer.collect(trainer.data_pos, seed=0)
    n = config.group_size
    assert rollout.env_mask_BxT.sum() > 0           # multi-turn rows with environment tokens
    assert sorted(set(rollout.source_B.tolist())) == [0, 1, 2, 3]
    logprobs = run.logprobs(trainer.state, rollout)  # what train_on computes first
    recorder = RecordingStep(run.programs.train_step)
    trainer.run = dataclasses.replace(run, programs=dataclasses.replace(
        run.programs, train_step=recorder))
    trainer.train_on(rollout, step=0)
    steps = list(loop.minibatch_rows(rollout.shape[0] // n, n, epochs=1, minibatches=2,
                                     rng=np.random.default_rng([config.seed, 0])))
    assert len(recorder.calls) == len(steps) == 2
    loss_config = rljax.LossConfig.from_config(config)
    assert loss_config == run.objective.loss and loss_config.kl_beta == 0.04
    logprob = run.programs.logprob_fn.jitted
    tokens, positions = jnp.asarray(rollout.tokens_BxT), jnp.asarray(rollout.positions_BxT)
    for k, (rows, (params, batch, metrics)) in enumerate(zip(steps, recorder.calls)):
        np.testing.assert_array_equal(batch.tokens, rollout.tokens_BxT[rows])  # the same rows
        logp_BxT = logprob(params, tokens, positions)[0]
        w = np.asarray(rljax.rollout_token_weights(run.objective, rollout, logp_BxT, logprobs,
                                                   rows=rows, version=0))
        # 1. minus the gradient of the step's loss on the step's own batch.
        lp_rows = jnp.asarray(logp_BxT)[rows]
        loss, grad = jax.value_and_grad(
            lambda lp: rljax.policy_loss(loss_config, lp, batch)[0])(lp_rows)
        np.testing.assert_allclose(w, -np.asarray(grad), rtol=1e-5, atol=1e-9,
                                   err_msg=f"minibatch {k}")
        np.testing.assert_allclose(loss, metrics["loss"], rtol=2e-5, atol=1e-7)
        # 2. pulled back through the model: the step's own parameter gradient norm.
        _, pullback = jax.vjp(lambda p: logprob(p, batch.tokens, batch.positions)[0], params)
        (g_params,) = pullback(-jnp.asarray(w))
        np.testing.assert_allclose(optax.global_norm(g_params), metrics["grad_norm"],
                                   rtol=1e-4, err_msg=f"minibatch {k}")
        # Every component carries weight; prompt and padding carry none.
        src = rollout.source_B[rows]
        comp = np.asarray([run.sources[i].spec.component for i in src])
        mask = rollout.loss_mask_BxT[rows] > 0
        env = rollout.env_mask_BxT[rows] > 0
        echo = src == [s.name for s in run.sources].index("echo")
        assert np.count_nonzero(w[(comp == "rl")[:, None] & mask]) > 10
        assert np.all(w[(comp == "ce")[:, None] & mask] > 0)        # sft targets pulled up
        assert np.all(w[echo[:, None] & env] > 0)                   # echo: env tokens too
        np.testing.assert_array_equal(w[~mask & ~(echo[:, None] & env)], 0.0)
    # The second step starts where the first left off: its ratios are no longer 1.
    assert recorder.calls[1][2]["ratio_max"] > recorder.calls[0][2]["ratio_max"]
    trainer.close()
