"""RL train step vs. a plain cross-entropy step: same model, tokens, optimizer.

Run: python experiments/bench/step_overhead.py [--preset small|smollm2-135m] [--batch 8] [--seq 256]

Both steps are jitted with donated state and timed interleaved in one
process (median of repeats), so the ratio isolates what the RL objective adds
(ratios, clipping, KL, metrics, the guard) on top of the forward/backward
pass that both share. Target: every ratio within 1.05.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rljax import normalizers
from rljax.batch import TrainBatch
from rljax.models import Decoder, get_preset
from rljax.models import logprobs as logprobs_lib
from rljax.train import config as config_lib
from rljax.train import step as step_lib

RECIPES = ("grpo", "dapo", "gspo", "cispo")


def make_ce_step(graphdef, optimizer, chunk_size):
    """The baseline: `-sum c logp` and an optax update, nothing else."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        logp = logprobs_lib.sequence_logprobs(model, batch.tokens, batch.positions,
                                              chunk_size=chunk_size)
        return -jnp.sum(batch.coef * logp)

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return state.replace(params=optax.apply_updates(state.params, updates),
                             opt_state=opt_state, step=state.step + 1), {"loss": loss}

    return jax.jit(step, donate_argnames=("state",))


def make_batch(cfg, b, t, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (b, t), dtype=np.int32)
    prompt = t // 4
    lens = rng.integers(t // 4, t - prompt + 1, b)
    mask = np.zeros((b, t), np.float32)
    for i, l in enumerate(lens):
        mask[i, prompt:prompt + l] = 1
    mask = jnp.asarray(mask)
    rewards = rng.integers(0, 2, b).astype(np.float32)
    adv = jnp.asarray(rewards - rewards.mean())[:, None] * mask
    return TrainBatch(
        tokens=jnp.asarray(tokens), positions=jnp.broadcast_to(jnp.arange(t), (b, t)),
        loss_mask=mask, behavior_logp=jnp.asarray(-rng.random((b, t)) * mask, jnp.float32),
        advantages=adv, coef=normalizers.coefficients(mask, mode="token_mean"),
        ref_logp=jnp.asarray(-rng.random((b, t)) * mask, jnp.float32))


def time_step(fn, state, batch, repeats):
    state, m = fn(state, batch)  # compile
    jax.block_until_ready(m)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, m = fn(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return state, times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small",
                   help="a model preset, or 'small' (d 256, 4 layers, vocab 8192)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.preset == "small":  # big enough that the model dominates, fast on CPU
        cfg = get_preset("tiny", d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                         head_dim=32, mlp_dim=1024, vocab_size=8192, max_seq_len=1024)
    else:
        cfg = get_preset(args.preset)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    optim = config_lib.get_config("grpo").optim
    optimizer = step_lib.make_optimizer(optim, 100)
    batch = make_batch(cfg, args.batch, args.seq)
    fns = {"ce": make_ce_step(graphdef, optimizer, 256)}
    for name in RECIPES:
        c = config_lib.get_config(name, **{"rollout.temperature": 1.0})
        fns[name] = step_lib.make_train_step(c, graphdef, optimizer, chunk_size=256)
    states = {k: step_lib.init_state(jax.tree.map(jnp.copy, params), optimizer)
              for k in fns}
    times = {k: [] for k in fns}
    for _ in range(args.rounds):  # interleaved rounds: drift hits every step alike
        for k, fn in fns.items():
            states[k], ts = time_step(fn, states[k], batch, args.repeats)
            times[k] += ts
    base = statistics.median(times["ce"])
    print(f"preset {args.preset} ({sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M "
          f"params), batch {args.batch} x {args.seq} tokens, {jax.devices()[0].platform}, "
          f"median of {args.rounds * args.repeats}")
    print()
    print("| step | median s | ratio to CE |")
    print("|---|---|---|")
    print(f"| cross-entropy | {base:.3f} | 1.000 |")
    for name in RECIPES:
        med = statistics.median(times[name])
        print(f"| {name} | {med:.3f} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
