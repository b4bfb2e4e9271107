"""The jitted train step: gradient accumulation, a guarded update, metrics.

`make_train_step` closes over the static parts (config, the model's graph,
the optimizer) and returns `step(state, batch) -> (state, metrics)`: the
batch is one optimizer step's rows with its coefficients already computed
over all of them (rljax.objective.train_batch), split into micro-batches and
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
    """Everything a step changes. params: the policy's nnx.State.

    step counts applied (not skipped) updates. Sampling seeds derive from the
    loop's step and the config's seed, so the state holds no RNG.
    """

    params: Any
    opt_state: Any
    step: jax.Array   # int32 []
    critic_params: Any = None      # PPO: the value model's nnx.State
    critic_opt_state: Any = None


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
        if k.startswith("loss") or k in ("kl", "num_tokens", "value_loss"):
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


def values_on_token_grid(critic, tokens_BxT, positions_BxT):
    """`V[b, t]`: the value of the prefix before token t (the state it was sampled in).

    The value model scores the prefix `tokens[:t+1]` at t; GAE needs the state
    in which token t was chosen, so values shift right by one (V[:, 0] = 0).
    """
    v = critic(tokens_BxT, positions_BxT)
    return jnp.concatenate([jnp.zeros_like(v[:, :1]), v[:, :-1]], axis=1)


def make_value_fn(critic_graphdef):
    """`(critic_params, tokens_BxT, positions_BxT) -> values_BxT`, jitted."""

    @jax.jit
    def fn(params, tokens_BxT, positions_BxT):
        return values_on_token_grid(nnx.merge(critic_graphdef, params), tokens_BxT,
                                    positions_BxT)
    return fn


def critic_loss(config, values_BxT, batch: TrainBatch):
    """PPO's clipped value loss `0.5 max((V - R)^2, (V_clip - R)^2)`, same coefficients.

    `V_clip = V_old + clip(V - V_old, -c, c)` keeps the critic inside a trust
    region around the values the advantages were computed with.
    """
    c = config.critic.clip
    m = batch.loss_mask > 0
    v = jnp.where(m, values_BxT, 0.0)
    old = jnp.where(m, batch.old_values, 0.0)
    ret = jnp.where(m, batch.returns, 0.0)
    v_clip = old + jnp.clip(v - old, -c, c)
    per_token = 0.5 * jnp.maximum(jnp.square(v - ret), jnp.square(v_clip - ret))
    loss = config.critic.coef * jnp.sum(jnp.where(m, batch.coef * per_token, 0.0))
    clipped = jnp.abs(v - old) > c
    count = jnp.maximum(jnp.sum(m), 1)
    return loss, {"value_loss": loss,
                  "value_clip_frac": jnp.sum(clipped & m) / count,
                  "value_mean": jnp.sum(v) / count}


def make_train_step(config, graphdef, optimizer, *, micro_batches: int = 1,
                    chunk_size: int = 256, critic_graphdef=None, critic_optimizer=None,
                    state_sharding=None, batch_sharding=None):
    """The jitted `step(state, batch) -> (state, metrics)`; state is donated.

    With a critic (PPO), the value model is trained in the same step on the
    batch's `returns`, with its own optimizer and the same guard. With
    `state_sharding` / `batch_sharding` (pytrees of NamedSharding, see
    rljax.parallel) the step is jitted with those in/out shardings.
    """
    temperature = config.rollout.temperature if "rollout" in config else 1.0
    loss_config = objective.LossConfig.from_config(config)

    # FSDP: weights are stored sharded over `fsdp` and gathered for compute (their
    # gradients reduce-scattered back); left to propagation, the compiler would
    # shard activations like the weights and replicate them to reshard.
    gather = critic_gather = None
    if state_sharding is not None:
        from rljax import parallel
        gather = parallel.compute_shardings(state_sharding.params)
        if critic_graphdef is not None:
            critic_gather = parallel.compute_shardings(state_sharding.critic_params)

    def loss_fn(params, mb: TrainBatch):
        if gather is not None:
            params = jax.lax.with_sharding_constraint(params, gather)
        model = nnx.merge(graphdef, params)
        logp, ent = logprobs_lib.sequence_logprobs(
            model, mb.tokens, mb.positions, routing_BxTxLxK=mb.routing,
            temperature=temperature, chunk_size=chunk_size, return_entropy=True)
        loss, metrics = objective.policy_loss(loss_config, logp, mb)
        m = mb.loss_mask > 0
        metrics["entropy"] = (jnp.sum(jnp.where(m, ent, 0.0))
                              / jnp.maximum(jnp.sum(m), 1))
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def critic_fn(params, mb: TrainBatch):
        if critic_gather is not None:
            params = jax.lax.with_sharding_constraint(params, critic_gather)
        critic = nnx.merge(critic_graphdef, params)
        return critic_loss(config, values_on_token_grid(critic, mb.tokens, mb.positions), mb)

    critic_grad_fn = jax.value_and_grad(critic_fn, has_aux=True)
    has_critic = critic_graphdef is not None

    def step(state: TrainState, batch: TrainBatch):
        mbs = batch.split(micro_batches)
        if batch_sharding is not None:
            # Keep rows, not micro-batches, on the batch axes: each scanned
            # micro-batch is then split over every data-parallel device.
            from rljax import parallel
            mbs = jax.lax.with_sharding_constraint(mbs, parallel.microbatch_sharding(batch_sharding))

        def body(acc, mb):
            (loss, metrics), grads = grad_fn(state.params, mb)
            acc_p = jax.tree.map(jnp.add, acc[0], grads)
            acc_c = acc[1]
            if has_critic:
                (_, vm), cgrads = critic_grad_fn(state.critic_params, mb)
                acc_c = jax.tree.map(jnp.add, acc_c, cgrads)
                metrics.update(vm)
            return (acc_p, acc_c), metrics

        zeros = (jax.tree.map(jnp.zeros_like, state.params),
                 jax.tree.map(jnp.zeros_like, state.critic_params) if has_critic else None)
        (grads, cgrads), stacked = jax.lax.scan(body, zeros, mbs)
        metrics = _combine_metrics(stacked)
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        if has_critic:
            ok = ok & jnp.isfinite(optax.global_norm(cgrads))

        def update(opt, g, opt_state, params):
            # Double-where: the optimizer never sees a NaN, so its moments stay clean.
            g = jax.tree.map(lambda x: jnp.where(ok, x, 0.0), g)
            updates, new_opt = opt.update(g, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
            return keep(new_params, params), keep(new_opt, opt_state)

        params, opt_state = update(optimizer, grads, state.opt_state, state.params)
        critic_params, critic_opt = state.critic_params, state.critic_opt_state
        if has_critic:
            critic_params, critic_opt = update(critic_optimizer, cgrads, critic_opt,
                                               critic_params)
        state = TrainState(
            params=params, opt_state=opt_state,
            step=state.step + ok.astype(jnp.int32),
            critic_params=critic_params, critic_opt_state=critic_opt,
        )
        metrics["grad_norm"] = grad_norm
        metrics["skipped"] = (~ok).astype(jnp.int32)
        return state, metrics

    if state_sharding is None and batch_sharding is None:
        return jax.jit(step, donate_argnames=("state",))
    return jax.jit(step, donate_argnames=("state",),
                   in_shardings=(state_sharding, batch_sharding),
                   out_shardings=(state_sharding, None))


def init_state(params, optimizer, critic_params=None, critic_optimizer=None) -> TrainState:
    return TrainState(
        params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
        critic_params=critic_params,
        critic_opt_state=None if critic_params is None else critic_optimizer.init(critic_params))
