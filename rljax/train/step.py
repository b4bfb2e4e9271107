"""The jitted train step: gradient accumulation, a guarded update, metrics.

`make_train_step` closes over the static parts (config, the model's graph,
the optimizer) and returns `step(state, batch) -> (state, metrics)`: the
batch is one optimizer step's rows with its coefficients already computed
over all of them (rljax.objective.rl_streams), split into micro-batches and
scanned, so the accumulated gradient is exactly the full-batch gradient.
A non-finite loss or gradient skips the update: params and optimizer state
are kept, `skipped` is 1 in the metrics, and the loop counts and logs it.
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rljax import objective
from rljax.batch import TrainBatch
from rljax.models import logprobs as logprobs_lib


@flax.struct.dataclass
class TrainState:
    """Everything a step changes. params: the policy's nnx.State."""

    params: Any
    opt_state: Any
    step: jax.Array   # int32 []
    rng: jax.Array    # PRNG key


def make_optimizer(optim, total_steps: int) -> optax.GradientTransformation:
    """AdamW with warmup + constant/cosine schedule and global-norm clipping.

    Weight decay applies to matrices only: decaying norm scales and biases
    pulls them towards 0, which no recipe intends.
    """
    if optim.schedule == "cosine":
        decay = max(total_steps - optim.warmup_steps, 1)
        sched = optax.warmup_cosine_decay_schedule(
            0.0 if optim.warmup_steps else optim.lr, optim.lr, optim.warmup_steps,
            optim.warmup_steps + decay, end_value=optim.lr * optim.min_ratio)
    elif optim.warmup_steps:
        sched = optax.join_schedules(
            [optax.linear_schedule(0.0, optim.lr, optim.warmup_steps),
             optax.constant_schedule(optim.lr)], [optim.warmup_steps])
    else:
        sched = optax.constant_schedule(optim.lr)
    decay_mask = lambda params: jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)
    chain = []
    if optim.grad_clip:
        chain.append(optax.clip_by_global_norm(optim.grad_clip))
    chain.append(optax.adamw(sched, b1=optim.b1, b2=optim.b2,
                             weight_decay=optim.weight_decay, mask=decay_mask))
    return optax.chain(*chain)


def _combine_metrics(stacked: dict) -> dict:
    """Micro-batch metrics -> one step's: token-weighted means, sums, min/max."""
    w = stacked["num_tokens"]
    total = jnp.maximum(jnp.sum(w), 1.0)
    out = {}
    for k, v in stacked.items():
        if k.startswith("loss") or k in ("kl", "num_tokens"):
            out[k] = jnp.sum(v)
        elif k.endswith("_min"):
            out[k] = jnp.min(v)
        elif k.endswith("_max"):
            out[k] = jnp.max(v)
        else:
            out[k] = jnp.sum(v * w) / total
    return out


def make_logprob_fn(graphdef, *, temperature: float, chunk_size: int = 256):
    """`(params, tokens_BxT, positions_BxT) -> (logp_BxT, entropy_BxT)`, jitted."""

    @jax.jit
    def fn(params, tokens_BxT, positions_BxT):
        model = nnx.merge(graphdef, params)
        return logprobs_lib.sequence_logprobs(
            model, tokens_BxT, positions_BxT, temperature=temperature,
            chunk_size=chunk_size, return_entropy=True)
    return fn


def make_train_step(config, graphdef, optimizer, *, micro_batches: int = 1,
                    chunk_size: int = 256):
    """The jitted `step(state, batch) -> (state, metrics)`; state is donated."""
    temperature = config.rollout.temperature if "rollout" in config else 1.0

    def loss_fn(params, mb: TrainBatch):
        model = nnx.merge(graphdef, params)
        logp, ent = logprobs_lib.sequence_logprobs(
            model, mb.tokens, mb.positions, routing_BxTxLxK=mb.routing,
            temperature=temperature, chunk_size=chunk_size, return_entropy=True)
        loss, metrics = objective.policy_loss(config, logp, mb)
        m = mb.loss_mask > 0
        metrics["entropy"] = (jnp.sum(jnp.where(m, ent, 0.0))
                              / jnp.maximum(jnp.sum(m), 1))
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch: TrainBatch):
        mbs = batch.split(micro_batches)

        def body(acc, mb):
            (loss, metrics), grads = grad_fn(state.params, mb)
            return jax.tree.map(jnp.add, acc, grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, stacked = jax.lax.scan(body, zeros, mbs)
        metrics = _combine_metrics(stacked)
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        # Double-where: the optimizer never sees a NaN, so its moments stay clean.
        safe_grads = jax.tree.map(lambda g: jnp.where(ok, g, 0.0), grads)
        updates, new_opt = optimizer.update(safe_grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        state = TrainState(
            params=keep(new_params, state.params),
            opt_state=keep(new_opt, state.opt_state),
            step=state.step + ok.astype(jnp.int32),
            rng=jax.random.fold_in(state.rng, state.step),
        )
        metrics["grad_norm"] = grad_norm
        metrics["skipped"] = (~ok).astype(jnp.int32)
        return state, metrics

    return jax.jit(step, donate_argnames=("state",))


def init_state(params, optimizer, seed: int) -> TrainState:
    return TrainState(params=params, opt_state=optimizer.init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(seed))
