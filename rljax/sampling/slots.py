"""Device side of continuous batching: a per-slot KV cache, refills, and chunks of decode steps.

The state has B decode slots. Slot b holds one row: its keys and values at
cache slots [0, length_B[b]), the last sampled token (`pending_B`, not yet
run through the model), how many tokens it has sampled (`step_B`) and its
sampling settings. Three jitted programs act on it, each with a fixed shape:

- `insert`: prefill R new rows (right-padded to a prompt bucket), write their
  keys/values into the slots given (a slot's old contents past the new
  length are masked, never read), and sample each row's token 0 from the
  prefill's logits.
- `decode_chunk`: up to `chunk` steps; each runs every slot's pending token
  at position length_B through the model, appends its keys/values, and
  samples the next token. It exits early when every slot is done or when
  `exit_at` slots are done (the host then refills them).
- `take`: the state restricted to some slots (shrinks the slot count when
  the tail of a call leaves most slots empty).

Decode attention reads only the blocks holding written keys: a loop over
`ceil(max(length_B) / block)` blocks of the cache, sliced straight out of
the stacked [L, B, S, KV, Dh] arrays, with an online softmax (Dao 2023,
arXiv:2307.08691) that starts from the token's own key. Nothing touches the
unused capacity, and the cache is written once per step (all layers
together, in place: the state is donated).

Randomness is the sampler's: token i of a row draws from
`fold_in(fold_in(key(seed), row_id), i)`, so a row's tokens do not depend on
its slot, its neighbours or when it was scheduled.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding

from rljax import parallel
from rljax.models import transformer as tfm
from jax._src.dispatch import BACKEND_COMPILE_EVENT  # the event name; no public constant exists
from rljax.sampling.decode import prefill, sample_step

DECODE_UNROLL = 4  # layers per decode-scan iteration: fewer loop trips, cross-layer fusion (measured faster on CPU)
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked score: exp() underflows to exactly 0


@struct.dataclass
class SlotState:
    """B slots of capacity S. k/v [L, B, S, KV, Dh]; the rest [B] (stop_BxS [B, n_stop],
    routing_BxLxK [B, L, K] for MoE, else [B, 0, 0]). Empty slots are done."""

    k: jax.Array
    v: jax.Array
    length_B: jax.Array       # int32: cache slots written = position of pending_B
    pending_B: jax.Array      # int32: last sampled token, not yet run through the model
    step_B: jax.Array         # int32: tokens sampled so far
    done_B: jax.Array         # bool
    stopped_B: jax.Array      # bool: ended on a stop token
    key_B: jax.Array          # typed PRNG keys: fold_in(key(seed), row_id)
    temperature_B: jax.Array
    top_k_B: jax.Array
    top_p_B: jax.Array
    max_new_B: jax.Array
    stop_BxS: jax.Array       # int32, padded with -1
    routing_BxLxK: jax.Array  # int32: experts of the forward that made the current logits


class Emitted(NamedTuple):
    """Tokens sampled by `insert` (T = 1) or `decode_chunk` (T = chunk): emitted_BxT marks
    real ones; routing_BxTxLxK is [B, T, 0, 0] for dense models."""

    tokens_BxT: jax.Array
    logp_BxT: jax.Array
    top_ids_BxTxN: jax.Array
    top_logp_BxTxN: jax.Array
    routing_BxTxLxK: jax.Array
    emitted_BxT: jax.Array


class NewRows(NamedTuple):
    """R rows to insert (host arrays). slot_R = B marks a padding row (writes dropped)."""

    prompt_RxP: jax.Array
    prompt_len_R: jax.Array
    slot_R: jax.Array
    seed_R: jax.Array
    row_id_R: jax.Array
    temperature_R: jax.Array
    top_k_R: jax.Array
    top_p_R: jax.Array
    max_new_R: jax.Array
    stop_RxS: jax.Array


def empty_state(config, slots: int, capacity: int, n_stop: int, mesh=None, rules=None) -> SlotState:
    """Every slot empty (done); capacity a multiple of the attention block."""
    B = slots
    L_K = (config.n_layers, config.experts_per_token) if config.is_moe else (0, 0)
    cache = tfm.init_cache(config, B, capacity)
    state = SlotState(
        k=cache.k, v=cache.v, length_B=jnp.zeros((B,), jnp.int32), pending_B=jnp.zeros((B,), jnp.int32),
        step_B=jnp.zeros((B,), jnp.int32), done_B=jnp.ones((B,), bool), stopped_B=jnp.zeros((B,), bool),
        key_B=jax.random.split(jax.random.key(0), B), temperature_B=jnp.ones((B,), jnp.float32),
        top_k_B=jnp.zeros((B,), jnp.int32), top_p_B=jnp.ones((B,), jnp.float32),
        max_new_B=jnp.zeros((B,), jnp.int32), stop_BxS=jnp.full((B, n_stop), -1, jnp.int32),
        routing_BxLxK=jnp.zeros((B,) + L_K, jnp.int32))
    return constrain(state, mesh, rules)


# ----------------------------------------------------------------------------
# Sharding: slots over the batch axes, cache heads over tensor (where they divide).


def constrain(state: SlotState, mesh, rules) -> SlotState:
    if mesh is None:
        return state

    def pin(x, names):
        spec = parallel.logical_to_spec(names, x.shape, mesh, rules)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    kv = ("layers", "batch", "length", "kv_heads", "head_dim")
    rows = {f.name: pin(getattr(state, f.name), ("batch",) + (None,) * (getattr(state, f.name).ndim - 1))
            for f in state.__dataclass_fields__.values() if f.name not in ("k", "v", "key_B")}
    return state.replace(k=pin(state.k, kv), v=pin(state.v, kv), **rows)


# ----------------------------------------------------------------------------
# One decode step: attention over the written blocks only.


def _slot_attention(q_BxHxDh, k_BxKVxDh, v_BxKVxDh, k_cache, v_cache, layer, length_B, n_blocks, block):
    """Each slot's query over its cached keys [0, length_B) and its own new key."""
    B, H, Dh = q_BxHxDh.shape
    KV = k_BxKVxDh.shape[1]
    G = H // KV
    f32 = jnp.float32
    q5 = q_BxHxDh.reshape(B, KV, G, Dh) * (1.0 / math.sqrt(Dh))
    # The token's own key starts the running softmax: max m, sum l = exp(0), acc = its value.
    m_BxKVxG = jnp.einsum("bkgd,bkd->bkg", q5, k_BxKVxDh, preferred_element_type=f32)
    l_BxKVxG = jnp.ones_like(m_BxKVxG)
    acc_BxKVxGxD = jnp.broadcast_to(v_BxKVxDh.astype(f32)[:, :, None, :], (B, KV, G, Dh))

    def body(j, carry):
        m, l, acc = carry
        start = (layer, 0, j * block, 0, 0)
        size = (1, B, block, KV, Dh)
        kj = jax.lax.dynamic_slice(k_cache, start, size)[0].astype(q5.dtype)
        vj = jax.lax.dynamic_slice(v_cache, start, size)[0].astype(q5.dtype)
        s = jnp.einsum("bkgd,bskd->bkgs", q5, kj, preferred_element_type=f32)
        valid_BxS = (j * block + jnp.arange(block, dtype=jnp.int32))[None, :] < length_B[:, None]
        s = jnp.where(valid_BxS[:, None, None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgs,bskd->bkgd", p.astype(vj.dtype), vj, preferred_element_type=f32)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, (m_BxKVxG, l_BxKVxG, acc_BxKVxGxD))
    return (acc / l[..., None]).reshape(B, H, Dh).astype(q_BxHxDh.dtype)


def decode_forward(model: tfm.Decoder, tokens_B, k_cache, v_cache, length_B, n_blocks, block):
    """Logits [B, V] (float32) of one token per slot at position length_B, the new keys and
    values [L, B, KV, Dh] (not yet written), and MoE experts [B, L, K] (else None).

    The Decoder's own blocks and weights, wired for one query over the slot cache:
    `Decoder.__call__` attends over every cache slot, which is what this avoids.
    """
    c = model.config
    cdt = c.compute_jnp_dtype
    x_BxD = jnp.take(model.embed[...], tokens_B, axis=0).astype(cdt)[:, None]
    cos, sin = tfm.rope_cos_sin(c, length_B[:, None])
    graphdef, stacked = nnx.split(model.layers)

    def body(x, xs):
        index, params = xs
        blk = nnx.merge(graphdef, nnx.spmd.remove_axis(params, 0, {nnx.PARTITION_NAME: tfm.LAYERS_AXIS}))
        attn = blk.attn
        h = blk.attn_norm(x)
        q, k, v = attn._project(h, attn.q, "q_bias"), attn._project(h, attn.k, "k_bias"), \
            attn._project(h, attn.v, "v_bias")
        if c.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = tfm.apply_rope(q, cos, sin), tfm.apply_rope(k, cos, sin)
        k_BxKVxDh, v_BxKVxDh = k[:, 0].astype(k_cache.dtype), v[:, 0].astype(v_cache.dtype)
        o = _slot_attention(q[:, 0], k_BxKVxDh.astype(cdt), v_BxKVxDh.astype(cdt), k_cache, v_cache, index,
                            length_B, n_blocks, block)
        x = x + jnp.einsum("bhd,hde->be", o, attn.o[...].astype(cdt))[:, None]
        if isinstance(blk.mlp, tfm.MoE):
            h, experts = blk.mlp(blk.mlp_norm(x))
            experts = experts[:, 0]
        else:
            h, experts = blk.mlp(blk.mlp_norm(x)), None
        return x + h, (k_BxKVxDh, v_BxKVxDh, experts)

    x_BxD, (k_LxBxKVxDh, v_LxBxKVxDh, experts_LxBxK) = jax.lax.scan(
            body, x_BxD, (jnp.arange(c.n_layers, dtype=jnp.int32), stacked), unroll=DECODE_UNROLL)
    hidden_BxD = model.final_norm(x_BxD)[:, 0]
    logits_BxV = jnp.einsum("bd,vd->bv", hidden_BxD, model.unembed_weight().astype(cdt),
                            preferred_element_type=jnp.float32)
    routing = None if experts_LxBxK is None else jnp.moveaxis(experts_LxBxK, 0, 1).astype(jnp.int32)
    return logits_BxV, k_LxBxKVxDh, v_LxBxKVxDh, routing


def _sample(state: SlotState, logits_BxV, live_B, n_top):
    keys_B = jax.vmap(jax.random.fold_in)(state.key_B, state.step_B)
    s = sample_step(logits_BxV, keys_B, state.temperature_B, state.top_k_B, state.top_p_B, n_top)
    hit_B = jnp.any(s.tokens_B[:, None] == state.stop_BxS, axis=1) & live_B
    step_B = state.step_B + live_B.astype(jnp.int32)
    done_B = state.done_B | hit_B | (live_B & (step_B >= state.max_new_B))
    state = state.replace(pending_B=jnp.where(live_B, s.tokens_B, state.pending_B), step_B=step_B,
                          done_B=done_B, stopped_B=state.stopped_B | hit_B)
    return state, s


def _emitted(s, routing_BxLxK, live_B) -> Emitted:
    return Emitted(jnp.where(live_B, s.tokens_B, 0)[:, None], jnp.where(live_B, s.logp_B, 0.0)[:, None],
                   s.top_ids_BxN[:, None], s.top_logp_BxN[:, None], routing_BxLxK[:, None], live_B[:, None])


# ----------------------------------------------------------------------------
# The programs.


def insert(graphdef, params, state: SlotState, new: NewRows, *, n_top: int, mesh=None, rules=None):
    """(state with the new rows in their slots, Emitted of token 0 [R, 1], prompt routing [R, P, L, K] or None)."""
    R, P = new.prompt_RxP.shape
    logits_RxV, cache, prompt_routing, last_routing = prefill(graphdef, params, new.prompt_RxP, new.prompt_len_R,
                                                              cache_len=P)
    B = state.done_B.shape[0]
    slot_R = new.slot_R
    real_R = slot_R < B
    # Keys/values of the prompt into slots [0, P); anything beyond stays, masked by length.
    k = state.k.at[:, slot_R, :P].set(cache.k.astype(state.k.dtype), mode="drop")
    v = state.v.at[:, slot_R, :P].set(cache.v.astype(state.v.dtype), mode="drop")
    keys_R = jax.vmap(lambda s, r: jax.random.fold_in(jax.random.key(s), r))(new.seed_R, new.row_id_R)
    routing_R = jnp.zeros((R,) + state.routing_BxLxK.shape[1:], jnp.int32) if last_routing is None \
        else last_routing.astype(jnp.int32)
    rows = SlotState(k=k[:0], v=v[:0], length_B=new.prompt_len_R, pending_B=jnp.zeros((R,), jnp.int32),
                     step_B=jnp.zeros((R,), jnp.int32), done_B=~real_R | (new.max_new_R <= 0),
                     stopped_B=jnp.zeros((R,), bool), key_B=keys_R, temperature_B=new.temperature_R,
                     top_k_B=new.top_k_R, top_p_B=new.top_p_R, max_new_B=new.max_new_R, stop_BxS=new.stop_RxS,
                     routing_BxLxK=routing_R)
    live_R = ~rows.done_B
    rows, s = _sample(rows, logits_RxV, live_R, n_top)
    out = _emitted(s, rows.routing_BxLxK, live_R)

    def put(old, upd):
        return old.at[slot_R].set(upd.astype(old.dtype), mode="drop")

    merged = {f: put(getattr(state, f), getattr(rows, f)) for f in state.__dataclass_fields__
              if f not in ("k", "v", "key_B")}
    key_data = jax.random.key_data(state.key_B).at[slot_R].set(jax.random.key_data(rows.key_B), mode="drop")
    state = state.replace(k=k, v=v, key_B=jax.random.wrap_key_data(key_data), **merged)
    return constrain(state, mesh, rules), out, prompt_routing


def decode_chunk(graphdef, params, state: SlotState, exit_at, *, chunk: int, block: int, n_top: int, mesh=None,
                 rules=None):
    """Up to `chunk` decode steps; stops early when all slots, or `exit_at` of them, are done.

    Returns (state, Emitted [B, chunk], steps run).
    """
    model = nnx.merge(graphdef, params)
    B = state.done_B.shape[0]
    S = state.k.shape[2]
    L_K = state.routing_BxLxK.shape[1:]
    outs = Emitted(jnp.zeros((B, chunk), jnp.int32), jnp.zeros((B, chunk), jnp.float32),
                   jnp.zeros((B, chunk, n_top), jnp.int32), jnp.zeros((B, chunk, n_top), jnp.float32),
                   jnp.zeros((B, chunk) + L_K, jnp.int32), jnp.zeros((B, chunk), bool))

    def cond(carry):
        t, state, _ = carry
        n_done = jnp.sum(state.done_B.astype(jnp.int32))
        return (t < chunk) & (n_done < B) & (n_done < exit_at)

    def body(carry):
        t, state, outs = carry
        live_B = ~state.done_B
        n_blocks = (jnp.max(jnp.where(live_B, state.length_B, 0)) + block - 1) // block
        logits, k_new, v_new, routing = decode_forward(model, state.pending_B, state.k, state.v, state.length_B,
                                                       n_blocks, block)
        # One write per step for every layer; finished slots write nowhere (index S is dropped).
        pos_B = jnp.where(live_B, state.length_B, S)
        rows_B = jnp.arange(B)
        k = state.k.at[:, rows_B, pos_B].set(k_new, mode="drop")
        v = state.v.at[:, rows_B, pos_B].set(v_new, mode="drop")
        routing = state.routing_BxLxK if routing is None else jnp.where(live_B[:, None, None], routing,
                                                                         state.routing_BxLxK)
        state = state.replace(k=k, v=v, length_B=state.length_B + live_B.astype(jnp.int32), routing_BxLxK=routing)
        state, s = _sample(state, logits, live_B, n_top)
        e = _emitted(s, routing, live_B)
        outs = Emitted(*(jax.lax.dynamic_update_slice_in_dim(o, x.astype(o.dtype), t, axis=1)
                         for o, x in zip(outs, e)))
        return t + 1, constrain(state, mesh, rules), outs

    t, state, outs = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state, outs))
    return state, outs, t


def take(state: SlotState, index_R, keep_R, *, mesh=None, rules=None) -> SlotState:
    """R slots: slot r is the old slot index_R[r] where keep_R[r], else empty (done)."""
    def one(name, x):
        if name in ("k", "v"):
            return x[:, index_R]
        if name == "key_B":
            return jax.random.wrap_key_data(jax.random.key_data(x)[index_R])
        return x[index_R]
    fields = {f: one(f, getattr(state, f)) for f in state.__dataclass_fields__}
    fields["done_B"] = fields["done_B"] | ~keep_R
    return constrain(SlotState(**fields), mesh, rules)


def release(state: SlotState, mask_B) -> SlotState:
    """The slots in mask_B emptied (their rows were cancelled)."""
    return state.replace(done_B=state.done_B | mask_B)


_STATIC = ("graphdef", "n_top", "mesh", "rules")
insert_jit = jax.jit(insert, static_argnames=_STATIC, donate_argnames=("state",))
decode_chunk_jit = jax.jit(decode_chunk, static_argnames=_STATIC + ("chunk", "block"), donate_argnames=("state",))
take_jit = jax.jit(take, static_argnames=("mesh", "rules"))  # new shapes: nothing to donate into
release_jit = jax.jit(release, donate_argnames=("state",))
empty_state_jit = jax.jit(empty_state, static_argnames=("config", "slots", "capacity", "n_stop", "mesh", "rules"))


# XLA compilations of the programs above, counted from JAX's compile events while an engine runs one
# (`counting()`). jit's own cache size overstates it: on a mesh, a second dispatch entry appears for
# the same executable on the first repeat call.
_compiles = 0
_counting = threading.local()


def _on_compile(event: str, duration: float, **kwargs) -> None:
    global _compiles
    if event == BACKEND_COMPILE_EVENT and getattr(_counting, "on", False):
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_compile)


@contextlib.contextmanager
def counting():
    """Compilations inside count towards compiled_programs()."""
    _counting.on = True
    try:
        yield
    finally:
        _counting.on = False


def compiled_programs() -> int:
    """Programs compiled so far by the slot programs (every engine together)."""
    return _compiles

