"""policy_loss, rl_streams and train_batch: gradients, micro-batch invariance, identities, jit.

One off-policy batch, B = 8 rows in 2 groups of 4, T = 6, is reused everywhere
so each jitted function compiles once per config.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax
from rljax import normalizers
from rljax import objective
from rljax import recipes
from rljax.batch import TrainBatch

B, T, N, LMAX = 8, 6, 4, 8
REWARDS = np.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], np.float32)
LENGTHS = [2, 5, 3, 4, 6, 1, 0, 3]
MASK = (np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]).astype(np.float32)
# Ratios pi / pi_old per real token, chosen away from every kink: PPO's 0.8,
# 1.2, 1.28, GMPO's e^+-0.4 = 0.670 / 1.492, by more than the FD step.
RHO = [
    [1.1, 0.9],                          # A+, row mean log -0.005 (inside)
    [0.45, 1.1, 1.7, 0.9, 1.1],          # A-
    [1.7, 1.7, 1.1],                     # A-, s = e^0.386: unclipped side
    [0.9, 0.9, 0.45, 1.1],               # A+, s = e^-0.229: unclipped side
    [1.7, 1.1, 1.7, 1.7, 0.9, 1.1],      # A+, s = e^0.280 > 1.2: clipped
    [0.45],                              # A-, s = 0.45 < 0.8: clipped
    [],
    [1.1, 0.9, 1.1],                     # A-, inside
]


def _arrays(rho=RHO):
    old = np.full((B, T), -1.2, np.float32)
    old[:, ::2] = -0.7
    logp = old.copy()
    for b, row in enumerate(rho):
        logp[b, :len(row)] += np.log(np.asarray(row, np.float32))
    ref = old - 0.3
    values = (0.1 * np.arange(T, dtype=np.float32))[None, :] * np.ones((B, 1), np.float32)
    return logp, old, ref, values


def _cfg(name, **kw):
    # The batches carry old_logp, so policy_loss measures the trust region
    # against it; token_weights gets old_logp too (as mu, the same ratio).
    return recipes.get(name, **kw)


def _batch(cfg, rewards=REWARDS, mask=MASK, rho=RHO):
    """(logp, the optimizer-step TrainBatch of every row, its Streams), as the trainer builds it."""
    logp, old, ref, values = _arrays(rho)
    obj = rljax.Objective.from_config(cfg, group_size=N, max_tokens=LMAX)
    rollout = rljax.Rollout.from_arrays(jnp.asarray(rewards), jnp.asarray(mask),
                                        behavior_logp_BxT=jnp.asarray(old))
    streams = rljax.token_streams(obj, rollout, rljax.Logprobs(
        old_logp_BxT=jnp.asarray(old), ref_logp_BxT=jnp.asarray(ref),
        values_BxT=jnp.asarray(values)))
    batch = rljax.train_batch(obj, streams, np.arange(B))
    return jnp.asarray(logp), batch, streams


def _loss(cfg):
    return rljax.LossConfig.from_config(cfg)


@functools.lru_cache(maxsize=None)
def _jitted(lc):
    loss = jax.jit(lambda lp, b: rljax.policy_loss(lc, lp, b)[0])
    return loss, jax.jit(jax.value_and_grad(loss))


def _loss_fn(cfg):
    return _jitted(_loss(cfg))[0]


def _value_and_grad(cfg):
    """Jitted value_and_grad of policy_loss, shared by every test of a config."""
    return _jitted(_loss(cfg))[1]


def _grad(cfg, logp, batch):
    return _value_and_grad(cfg)(logp, batch)[1]


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compilations inside the block."""
    events = []

    def listener(name, _secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# --- finite differences --------------------------------------------------------------
# CISPO (-sg(w) A logp) and REINFORCE (-A exp(logp - sg(logp))) have loss values
# that are not potentials of their gradients by design (the stop-gradients), so
# a finite difference of the value cannot match their token weights.
FD_RECIPES = [
    ("grpo", {}), ("dapo", {}), ("dr_grpo", {}), ("gmpo", {}), ("sapo", {}),
    ("ppo", {}), ("max_rl", {}),
    # GSPO's 3e-4 window is narrower than any usable float32 step: widen it.
    ("gspo", {"loss.eps_low": 0.2, "loss.eps_high": 0.2}),
    ("gspo", {"loss.eps_low": 0.2, "loss.eps_high": 0.2,
              "loss.type": "sequence_clip_token"}),
]


@pytest.mark.parametrize("name,over", FD_RECIPES,
                         ids=[n + ("_token" if "loss.type" in o else "") for n, o in FD_RECIPES])
def test_token_weights_equal_finite_differences_of_policy_loss(name, over):
    cfg = _cfg(name, **over)
    logp, batch, _ = _batch(cfg)
    loss = _loss_fn(cfg)
    w = -np.asarray(_grad(cfg, logp, batch))

    # Central differences on every position (padding included), vmapped: one compile.
    h = 1e-2
    eye = jnp.eye(B * T, dtype=jnp.float32).reshape(B * T, B, T) * h
    vloss = jax.jit(jax.vmap(loss, in_axes=(0, None)))
    fd = (vloss(logp[None] + eye, batch) - vloss(logp[None] - eye, batch)) / (2 * h)
    fd_w = -np.asarray(fd).reshape(B, T)
    np.testing.assert_allclose(w, fd_w, atol=3e-5, rtol=2e-3)
    # The check has teeth: real tokens carry weight, padding exactly none.
    assert np.count_nonzero(w[MASK > 0]) >= 10
    np.testing.assert_array_equal(w[MASK == 0], 0.0)
    # token_weights (the public inspection API) agrees with jax.grad here.
    tw = rljax.token_weights(cfg, REWARDS, MASK, group_size=N, max_tokens=LMAX,
                             logp=logp, old_logp=batch.old_logp, ref_logp=batch.ref_logp,
                             values=_arrays()[3])
    np.testing.assert_allclose(np.asarray(tw), w, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", ["grpo", "gmpo", "ppo"])
def test_nan_and_inf_padding_gives_exactly_zero_gradient(name):
    cfg = _cfg(name)
    logp, batch, _ = _batch(cfg)
    pad = MASK == 0
    vg = _value_and_grad(cfg)
    g_clean = np.asarray(vg(logp, batch)[1])
    bad_logp = jnp.where(pad, jnp.nan, logp)
    bad = batch.replace(old_logp=jnp.where(pad, -jnp.inf, batch.old_logp),
                        behavior_logp=jnp.where(pad, jnp.inf, batch.behavior_logp),
                        ref_logp=jnp.where(pad, jnp.nan, batch.ref_logp))
    v, g = vg(bad_logp, bad)
    assert np.isfinite(v)
    g = np.asarray(g)
    np.testing.assert_array_equal(g[pad], 0.0)
    np.testing.assert_allclose(g, g_clean, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(v, vg(logp, batch)[0], rtol=1e-6)
    # -inf logp on padding too.
    g_inf = np.asarray(vg(jnp.where(pad, -jnp.inf, logp), bad)[1])
    np.testing.assert_array_equal(g_inf[pad], 0.0)
    assert np.all(np.isfinite(g_inf))


# --- micro-batch invariance -----------------------------------------------------------

@pytest.mark.parametrize("name", recipes.names())
def test_micro_batch_gradients_sum_to_the_full_batch_gradient(name):
    cfg = _cfg(name)
    logp, batch, _ = _batch(cfg)
    grad = _value_and_grad(cfg)
    v_full, g_full = grad(logp, batch)
    assert np.count_nonzero(np.asarray(g_full)) >= 10
    for k in (2, 4):
        mb = batch.split(k)
        lp = logp.reshape(k, B // k, T)
        vs, gs = zip(*(grad(lp[i], jax.tree.map(lambda x: x[i], mb)) for i in range(k)))
        np.testing.assert_allclose(sum(vs), v_full, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.concatenate(gs), g_full, rtol=1e-5, atol=1e-8)
        # rows() gives the same micro-batches as split().
        r = batch.rows(slice(0, B // k))
        np.testing.assert_array_equal(r.coef, mb.coef[0])


def test_micro_batch_invariance_needs_full_batch_coefficients():
    # Negative control: normalizing each micro-batch locally (verl's legacy path)
    # changes the gradient, so the invariance test above can fail.
    cfg = _cfg("grpo")
    logp, batch, _ = _batch(cfg)
    g_full = np.asarray(_grad(cfg, logp, batch))
    local = []
    for i in range(2):
        rows = slice(4 * i, 4 * i + 4)
        coef = normalizers.coefficients(jnp.asarray(MASK[rows]), mode=cfg.loss.norm)
        local.append(np.asarray(_grad(cfg, logp[rows], batch.rows(rows).replace(coef=coef))))
    # Group 1 has B' = 4 locally vs 7 in the full batch: weights scale by 7/4.
    np.testing.assert_allclose(local[0], g_full[:4] * 7 / 4, rtol=1e-5, atol=1e-9)
    assert not np.allclose(np.concatenate(local), g_full)


# --- identities ------------------------------------------------------------------------
# GSPO's window is [1 - 3e-4, 1 + 4e-4], i.e. row mean log-ratio in
# [-3.0005e-4, 3.9992e-4]. Row means below: in, out (high), out (low), in, in,
# out (high), empty, in; +-1e-4 zero-mean wiggles make the tokens differ.
_GSPO_MEANS = [1e-4, 6e-4, -6e-4, 2e-4, -1e-4, 9e-4, 0.0, 0.0]


def _gspo_rho():
    rho = []
    for m, l in zip(_GSPO_MEANS, LENGTHS):
        wig = [(1e-4 if t % 2 == 0 else -1e-4) for t in range(l)]
        if l % 2:
            wig[-1] = 0.0
        rho.append([math.exp(m + w) for w in wig])
    return rho


@pytest.mark.parametrize("norm", ["seq_mean", "seq_mean_token_mean"])
def test_gspo_token_equals_gspo_for_row_advantages(norm):
    gspo = _cfg("gspo")
    tok = _cfg("gspo", **{"loss.type": "sequence_clip_token", "loss.norm": norm})
    assert gspo.loss.type == "sequence_clip" and tok.loss.type == "sequence_clip_token"
    rho = _gspo_rho()
    logp, batch, _ = _batch(gspo, rho=rho)
    logp_t, batch_t, _ = _batch(tok, rho=rho)
    np.testing.assert_allclose(batch.coef, batch_t.coef, rtol=1e-6)
    v, g = _value_and_grad(gspo)(logp, batch)
    vt, gt = _value_and_grad(tok)(logp_t, batch_t)
    np.testing.assert_allclose(vt, v, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gt), np.asarray(g), rtol=1e-5, atol=1e-9)
    g = np.asarray(g)
    # Clipped rows (1: A<0 high is the unclipped side, so it keeps a gradient;
    # 2: A<0 low -> clipped; 5: A<0 high -> kept) and inside rows 0, 3, 4, 7.
    assert np.all(g[2] == 0.0)
    for b in (0, 1, 3, 4, 5, 7):
        assert np.all(g[b, :LENGTHS[b]] != 0.0), b
    # Row 0 (A+, L 2): w = A s / (B' L) = 0.999998 * e^1e-4 / 14 = 0.0714356.
    np.testing.assert_allclose(-g[0, 0], 0.999998 * math.exp(1e-4) / 14, rtol=1e-5)


def test_dr_grpo_equals_grpo_without_std_with_constant_normalizer_and_no_kl():
    grpo, dr = _cfg("grpo"), _cfg("dr_grpo")
    over = {"advantage.scale": "none", "loss.norm": "token_sum_norm",
            "kl.placement": "none"}
    grpo_dr = _cfg("grpo", **over)
    # The two recipes differ on exactly these three axes' fields.
    for k in over:
        sec, leaf = k.split(".")
        assert grpo[sec][leaf] != dr[sec][leaf], k
    d1, d2 = grpo_dr.to_dict(), dr.to_dict()
    # Only the name and kl.beta (inert with placement 'none') remain different.
    for d in (d1, d2):
        d.pop("recipe"), d["kl"].pop("beta")
    assert d1 == d2
    logp, old, ref, _ = _arrays()
    kw = dict(group_size=N, max_tokens=LMAX, logp=logp, old_logp=old, ref_logp=ref)
    w_dr = np.asarray(rljax.token_weights(dr, REWARDS, MASK, **kw))
    w_gd = np.asarray(rljax.token_weights(grpo_dr, REWARDS, MASK, **kw))
    w_g = np.asarray(rljax.token_weights(grpo, REWARDS, MASK, **kw))
    np.testing.assert_array_equal(w_gd, w_dr)
    assert not np.allclose(w_g, w_dr)
    # Row 0 token 0 (A = 0.5 unscaled, rho 1.1 kept): 0.5 * 1.1 / (8 * 8) = 0.00859375
    np.testing.assert_allclose(w_dr[0, 0], 0.00859375, rtol=1e-5)


def test_max_rl_changes_only_the_advantages():
    grpo, mrl = _cfg("grpo"), _cfg("max_rl")
    assert grpo.advantage.scale == "group_std" and mrl.advantage.scale == "group_mean"
    d1, d2 = grpo.to_dict(), mrl.to_dict()
    for d in (d1, d2):
        d.pop("recipe"), d["advantage"].pop("scale")
    assert d1 == d2
    logp, b_grpo, s_grpo = _batch(grpo)
    _, b_mrl, s_mrl = _batch(mrl)
    np.testing.assert_array_equal(b_mrl.coef, b_grpo.coef)
    # MaxRL (r - mean)/mean: (1,-1,-1,1, 3,-1,-1,-1) on each row's tokens.
    np.testing.assert_allclose(
        s_mrl.advantages_BxT,
        np.asarray([1, -1, -1, 1, 3, -1, -1, -1], np.float32)[:, None] * MASK, rtol=1e-6)
    assert not np.allclose(s_mrl.advantages_BxT, s_grpo.advantages_BxT)
    # The loss is grpo's loss evaluated with MaxRL's advantages.
    v_m, g_m = _value_and_grad(mrl)(logp, b_mrl)
    v_g, g_g = _value_and_grad(grpo)(logp, b_mrl)
    np.testing.assert_allclose(v_m, v_g, rtol=1e-6)
    np.testing.assert_allclose(g_m, g_g, rtol=1e-6, atol=1e-9)


def test_kl_in_loss_value_matches_spec_check():
    # docs/algorithms.md §6: logp = -1, ref = -1.5 -> k3 = e^-0.5 + 0.5 - 1 = 0.1065307.
    cfg = _cfg("grpo")
    mask = np.zeros((B, T), np.float32)
    mask[0, 0] = 1.0
    lp = jnp.full((B, T), -1.0)
    batch = TrainBatch(tokens=jnp.zeros((B, T), jnp.int32),
                       positions=jnp.zeros((B, T), jnp.int32),
                       loss_mask=jnp.asarray(mask), behavior_logp=lp,
                       advantages=jnp.zeros((B, T)), coef=jnp.asarray(mask),
                       old_logp=lp, ref_logp=jnp.full((B, T), -1.5))
    loss, m = rljax.policy_loss(_loss(cfg), lp, batch)
    # A = 0: the clip term is 0; loss = c beta k3 = 0.04 * 0.1065307 = 0.00426123.
    np.testing.assert_allclose(loss, 0.04 * 0.1065307, rtol=1e-5)
    np.testing.assert_allclose(m["kl"], 0.1065307, rtol=1e-5)


def test_ce_and_ref_kl_components():
    # rl component silent (A = 0, dapo: no KL); ce weight 0.5 on row 0 tokens
    # 0-1; ref_kl weight 0.25 on row 1 tokens 0-2 with teacher = logp - 0.4.
    cfg = _cfg("dapo")
    lp = jnp.full((B, T), -1.0)
    ce = np.zeros((B, T), np.float32)
    ce[0, :2] = 0.5
    rk = np.zeros((B, T), np.float32)
    rk[1, :3] = 0.25
    teacher = np.where(rk > 0, -1.4, np.nan).astype(np.float32)   # NaN off its tokens
    batch = TrainBatch(tokens=jnp.zeros((B, T), jnp.int32),
                       positions=jnp.zeros((B, T), jnp.int32), loss_mask=jnp.asarray(MASK),
                       behavior_logp=lp, advantages=jnp.zeros((B, T)),
                       coef=jnp.asarray(MASK) / 24.0, ce_coef=jnp.asarray(ce),
                       ref_kl_coef=jnp.asarray(rk), teacher_logp=jnp.asarray(teacher))
    lc = _loss(cfg)
    (loss, m), g = jax.value_and_grad(lambda x: rljax.policy_loss(lc, x, batch),
                                      has_aux=True)(lp)
    # ce: -sum 0.5 * logp = -0.5 * (-1) * 2 = 1.0
    np.testing.assert_allclose(m["loss_ce"], 1.0, rtol=1e-6)
    # ref_kl value: k1 = logp - teacher = 0.4 per token: 0.25 * 0.4 * 3 = 0.3
    np.testing.assert_allclose(m["loss_ref_kl"], 0.3, rtol=1e-6)
    np.testing.assert_allclose(loss, 1.3, rtol=1e-6)
    w = -np.asarray(g)
    expected = np.zeros((B, T))
    expected[0, :2] = 0.5                    # w = ce weight
    expected[1, :3] = 0.25 * (-1.4 + 1.0)    # w = c (teacher - logp) = -0.1: toward teacher
    np.testing.assert_allclose(w, expected, rtol=1e-6, atol=1e-9)


# --- jit, no jit, and no recompilation ------------------------------------------------

@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_compute_advantages_with_and_without_jit(jit):
    cfg = recipes.get("grpo")
    r = jnp.asarray([1.0, 0.0, 0.0, 0.0])
    if jit:
        est = rljax.Estimator.from_config(cfg)
        f = jax.jit(lambda r: objective.row_advantages(est, r, group_size=4).advantages_B)
        a = f(r)
    else:
        a = rljax.compute_advantages(cfg, r, group_size=4)
    # 0.75 / (0.4330127 + 1e-6) = 1.7320468 ; -0.25 / 0.4330137 = -0.5773489
    np.testing.assert_allclose(a, [1.7320468, -0.5773489, -0.5773489, -0.5773489],
                               rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_policy_loss_jit_matches_eager_and_does_not_recompile(name):
    cfg = _cfg(name)
    fc = _loss(cfg)
    logp, batch, _ = _batch(cfg)
    eager_v, eager_m = rljax.policy_loss(fc, logp, batch)
    step = jax.jit(jax.value_and_grad(rljax.policy_loss, argnums=1, has_aux=True),
                   static_argnums=0)
    (v, m), g = step(fc, logp, batch)
    np.testing.assert_allclose(v, eager_v, rtol=1e-6)
    for k in eager_m:
        np.testing.assert_allclose(m[k], eager_m[k], rtol=1e-5, atol=1e-7, err_msg=k)
    if name == "grpo":   # an eager gradient is slow; one config shows it agrees
        g_eager = jax.grad(lambda lp: rljax.policy_loss(fc, lp, batch)[0])(logp)
        np.testing.assert_allclose(g, g_eager, rtol=1e-6, atol=1e-9)
    # A second step with new values and the same shapes compiles nothing.
    batch2 = batch.replace(advantages=-batch.advantages, old_logp=batch.old_logp - 0.1)
    logp2 = logp + 0.05
    with count_compiles() as compiles:
        (v2, _), _ = step(rljax.LossConfig.from_config(cfg), logp2, batch2)
        v2.block_until_ready()
    assert compiles == []
    assert step._cache_size() == 1
    assert v2 != v


def test_token_weights_and_rl_streams_do_not_recompile():
    cfg = _cfg("grpo")
    logp, old, ref, _ = _arrays()
    kw = dict(group_size=N, max_tokens=LMAX, old_logp=old, ref_logp=ref)
    w1 = rljax.token_weights(cfg, REWARDS, MASK, logp=logp, **kw)
    logp2 = logp + np.float32(0.01)
    with count_compiles() as compiles:
        w2 = rljax.token_weights(cfg, REWARDS[::-1].copy(), MASK, logp=logp2, **kw)
        w2.block_until_ready()
    assert compiles == []
    assert not np.allclose(w1, w2)
    # rl_streams under jit (estimator and group size static): once per shape.
    f = jax.jit(rljax.rl_streams, static_argnums=0, static_argnames=("group_size",))
    est = rljax.Estimator.from_config(cfg)
    s1 = f(est, jnp.asarray(REWARDS), jnp.asarray(MASK), group_size=N)
    r2, m2 = jnp.asarray(REWARDS[::-1].copy()), jnp.asarray(MASK)
    with count_compiles() as compiles:
        s2 = f(est, r2, m2, group_size=N)
        s2.advantages_BxT.block_until_ready()
    assert compiles == [] and f._cache_size() == 1
    s_eager = rljax.rl_streams(est, jnp.asarray(REWARDS), jnp.asarray(MASK), group_size=N)
    np.testing.assert_allclose(s1.advantages_BxT, s_eager.advantages_BxT, rtol=1e-6)
    np.testing.assert_array_equal(s1.mask_BxT, s_eager.mask_BxT)
    assert not np.allclose(s1.advantages_BxT, s2.advantages_BxT)


def test_token_weights_under_an_outer_jit():
    cfg = _cfg("dapo")
    logp, old, _, _ = _arrays()
    f = jax.jit(lambda r, m, lp, o: rljax.token_weights(cfg, r, m, group_size=N,
                                                        logp=lp, old_logp=o))
    w_jit = f(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(logp), jnp.asarray(old))
    w = rljax.token_weights(cfg, REWARDS, MASK, group_size=N, logp=logp, old_logp=old)
    np.testing.assert_allclose(w_jit, w, rtol=1e-6, atol=1e-9)
