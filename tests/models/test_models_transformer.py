"""Decoder: KV cache vs. full forward, padding, RoPE variants, remat, MoE routing and replay, axis names."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models import config as config_lib
from rljax.models.config import get_preset
from rljax.models.transformer import Decoder, init_cache, rope_inv_freq

AXES = {"layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts"}


def _pure(model):
    """(fn(state, *args, **kw) -> DecoderOutput, state): a jittable view of the model."""
    graphdef, state = nnx.split(model)

    def fn(state, *args, **kwargs):
        return nnx.merge(graphdef, state)(*args, **kwargs)

    return fn, state


def _tokens(key, shape, vocab=256):
    return jax.random.randint(jax.random.key(key), shape, 0, vocab)


def test_presets_and_unknown_name():
    assert set(config_lib.preset_names()) >= {"tiny", "tiny-moe", "smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b"}
    assert get_preset("qwen3-0.6b").qk_norm and get_preset("qwen2.5-0.5b").qkv_bias
    assert get_preset("tiny", param_dtype="bfloat16").param_dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*tiny-moe"):
        get_preset("gpt5")
    with pytest.raises(ValueError, match="remat='some'"):
        get_preset("tiny", remat="some")
    # Hashable, so it can be a static jit argument; equal dicts give equal configs.
    a = get_preset("tiny", rope_scaling={"rope_type": "linear", "factor": 2.0})
    b = get_preset("tiny", rope_scaling={"factor": 2.0, "rope_type": "linear"})
    assert hash(a) == hash(b) and a == b


def test_every_param_has_logical_axes():
    for name in ("tiny", "tiny-moe"):
        config = get_preset(name, tie_embeddings=False, qkv_bias=True, qk_norm=True)
        model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))  # metadata only, no compute
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            axes = var.get_metadata()["out_sharding"]
            assert len(axes) == len(var.get_value().shape), path
            assert set(axes) <= AXES, (path, axes)
            # Block parameters are stacked on a leading layer axis, and only they are.
            assert (axes[0] == "layers") == (path[0] == "layers"), (path, axes)
            if path[0] == "layers":
                assert var.get_value().shape[0] == config.n_layers and "layers" not in axes[1:], path
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        assert tuple(specs["embed"].get_value()) == ("vocab", "embed")


def test_default_positions_and_shapes(tiny_config):
    model = Decoder(tiny_config, rngs=nnx.Rngs(0))
    tokens = _tokens(0, (2, 5))
    out = model(tokens)
    chex.assert_shape(out.logits, (2, 5, 256))
    chex.assert_shape(out.hidden, (2, 5, 64))
    assert out.logits.dtype == jnp.float32 and out.cache is None and out.routing is None
    explicit = model(tokens, jnp.broadcast_to(jnp.arange(5), (2, 5)), attn_mask_BxT=jnp.ones((2, 5), bool))
    np.testing.assert_array_equal(out.logits, explicit.logits)
    hidden_only = model(tokens, return_hidden=True)
    assert hidden_only.logits is None
    np.testing.assert_allclose(out.logits, hidden_only.hidden @ model.unembed_weight().T, atol=1e-5)


def test_right_padding_does_not_change_real_tokens(tiny_config):
    model = Decoder(tiny_config, rngs=nnx.Rngs(1))
    short = _tokens(1, (1, 4))
    padded = jnp.concatenate([short, jnp.full((1, 3), 7)], axis=1)
    mask = jnp.arange(7)[None, :] < 4
    alone = model(short).logits
    with_pad = model(padded, attn_mask_BxT=mask).logits
    np.testing.assert_allclose(with_pad[:, :4], alone, atol=1e-5)
    # The padding itself still gets finite logits (no NaN from masked rows).
    assert np.isfinite(np.asarray(with_pad)).all()


@pytest.mark.parametrize("name,attention", [("tiny", "xla"), ("tiny-moe", "xla"), ("tiny", "blockwise")])
def test_cache_prefill_then_decode_equals_full_forward(name, attention):
    # Blockwise with 4-token blocks: the prefill attends over the 16 cache slots block by block.
    config = get_preset(name, qkv_bias=True, qk_norm=True, attention=attention, attention_block_q=4,
                        attention_block_kv=4)
    model = Decoder(config, rngs=nnx.Rngs(2))
    fn, state = _pure(model)
    step = jax.jit(fn)  # (the same code runs eagerly in the other tests)
    B, T_prompt, T_total = 3, 6, 11
    full_tokens = _tokens(3, (B, T_total))
    lengths = np.array([6, 3, 4])  # right-padded prompts of different lengths
    full = fn(state, full_tokens)

    # Prefill: row b holds its first lengths[b] tokens then padding (junk ids).
    positions = jnp.broadcast_to(jnp.arange(T_prompt), (B, T_prompt))
    prompt_mask = positions < lengths[:, None]
    prompt = jnp.where(prompt_mask, full_tokens[:, :T_prompt], 5)
    cache = init_cache(config, B, 16, jnp.float32)
    out = step(state, prompt, positions, attn_mask_BxT=prompt_mask, cache=cache)
    for b in range(B):
        np.testing.assert_allclose(out.logits[b, :lengths[b]], full.logits[b, :lengths[b]], atol=1e-5)
    np.testing.assert_array_equal(out.cache.lengths_B, lengths)

    # Decode one token at a time at each row's own next position.
    cache = out.cache
    for i in range(T_total - lengths.max()):
        pos = lengths + i
        tok = full_tokens[jnp.arange(B), pos][:, None]
        out = step(state, tok, jnp.asarray(pos)[:, None], cache=cache)
        cache = out.cache
        for b in range(B):
            np.testing.assert_allclose(out.logits[b, 0], full.logits[b, pos[b]], atol=1e-5)
            if out.routing is not None:
                np.testing.assert_array_equal(out.routing[b, 0], full.routing[b, pos[b]])
    np.testing.assert_array_equal(cache.lengths_B, lengths + T_total - lengths.max())


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_transformers(scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                                  rope_parameters={"rope_theta": 10000.0, **scaling})
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    inv_freq, factor = rope_inv_freq(get_preset("tiny", rope_scaling=scaling))
    np.testing.assert_allclose(inv_freq, ref_inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(ref_factor)
    # The variant really changes the frequencies (the test can fail).
    assert not np.allclose(inv_freq, rope_inv_freq(get_preset("tiny"))[0])


def _grads(config, tokens):
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(4)))

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens).logits
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])

    return jax.jit(jax.grad(loss))(state), str(jax.make_jaxpr(jax.grad(loss))(state))


@pytest.mark.parametrize("name", ["tiny-moe"])  # attention, MoE and (through the router) dense paths
def test_remat_policies_give_the_same_gradients(name):
    tokens = _tokens(5, (2, 8))
    base, base_jaxpr = _grads(get_preset(name, remat="none", n_layers=1), tokens)
    assert "remat" not in base_jaxpr and "checkpoint" not in base_jaxpr
    for policy in ("full", "dots_saveable"):
        grads, jaxpr = _grads(get_preset(name, remat=policy, n_layers=1), tokens)
        # The policy is really in the program (else this compares a model with itself).
        assert "remat" in jaxpr or "checkpoint" in jaxpr, policy
        chex.assert_trees_all_close(grads, base, atol=1e-6, rtol=1e-6)


def test_bfloat16_params_and_compute_run_close_to_float32(tiny_config):
    tokens = _tokens(6, (2, 8))
    f32 = Decoder(tiny_config, rngs=nnx.Rngs(7))
    bf16 = Decoder(tiny_config.replace(param_dtype="bfloat16", compute_dtype="bfloat16"), rngs=nnx.Rngs(7))
    assert bf16.embed[...].dtype == jnp.bfloat16
    # Same weights, rounded to bfloat16.
    nnx.update(bf16, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32, nnx.Param)))
    call = nnx.jit(lambda m, t: m(t))
    out = call(bf16, tokens)
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    ref = call(f32, tokens).logits
    diff = float(jnp.abs(out.logits - ref).max())
    assert 0 < diff < 0.05 * float(jnp.abs(ref).max()), diff


# ----------------------------------------------------------------------------
# Mixture of experts.


def _dense_moe_reference(moe, x_BxTxD, k):
    """Every expert on every token, weighted by renormalised top-k gates (zero elsewhere)."""
    probs = jax.nn.softmax(x_BxTxD @ moe.router[...], axis=-1)
    top_p, top_i = jax.lax.top_k(probs, k)
    gates = jnp.zeros_like(probs).at[
        jnp.arange(probs.shape[0])[:, None, None], jnp.arange(probs.shape[1])[None, :, None], top_i
    ].set(top_p / top_p.sum(-1, keepdims=True))
    out = jnp.zeros_like(x_BxTxD)
    for e in range(probs.shape[-1]):
        h = jax.nn.silu(x_BxTxD @ moe.gate[...][e]) * (x_BxTxD @ moe.up[...][e])
        out = out + gates[..., e:e + 1] * (h @ moe.down[...][e])
    return out, top_i


def test_moe_matches_dense_reference():
    config = get_preset("tiny-moe")
    model = Decoder(config, rngs=nnx.Rngs(8))
    moe = model.layer(0).mlp
    x = jax.random.normal(jax.random.key(9), (2, 7, config.d_model))
    out, experts = nnx.jit(lambda moe, x: moe(x))(moe, x)
    ref, ref_experts = _dense_moe_reference(moe, x, config.experts_per_token)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_array_equal(experts, ref_experts)
    # Tokens do spread over experts (else the grouped matmul is barely tested).
    assert len(np.unique(np.asarray(experts))) == config.n_experts


def test_moe_routing_replay():
    config = get_preset("tiny-moe")
    fn, state = _pure(Decoder(config, rngs=nnx.Rngs(10)))
    fn = jax.jit(fn)
    tokens = _tokens(11, (2, 9))
    out = fn(state, tokens)
    chex.assert_shape(out.routing, (2, 9, config.n_layers, config.experts_per_token))
    assert out.routing.dtype == jnp.int32
    replayed = fn(state, tokens, routing_BxTxLxK=out.routing)
    np.testing.assert_allclose(replayed.logits, out.logits, atol=1e-6)

    # Change the routers: fresh routing differs, replayed routing does not.
    new_state = jax.tree_util.tree_map(lambda x: x, state)
    router = new_state["layers"]["mlp"]["router"]  # [L, D, E], stacked over layers
    router.set_value(jax.random.normal(jax.random.key(12), router.get_value().shape))
    fresh = fn(new_state, tokens)
    assert (np.asarray(fresh.routing) != np.asarray(out.routing)).any()
    again = fn(new_state, tokens, routing_BxTxLxK=out.routing)
    np.testing.assert_array_equal(again.routing, out.routing)
    assert not np.allclose(again.logits, fresh.logits)

    # With replayed experts the router still gets a gradient (through the gates).
    def loss(state):
        return jnp.mean(fn(state, tokens, routing_BxTxLxK=out.routing).logits ** 2)

    grads = jax.jit(jax.grad(loss))(new_state)
    assert float(jnp.abs(grads["layers"]["mlp"]["router"].get_value()[0]).max()) > 0

    with pytest.raises(ValueError, match="no experts"):
        Decoder(get_preset("tiny"), rngs=nnx.Rngs(0))(tokens, routing_BxTxLxK=out.routing)


def test_auto_remat_rematerialises_only_long_forwards():
    # auto = "full" from AUTO_REMAT_MIN_TOKENS tokens (B * T) of one forward, else "none".
    from rljax.models.config import AUTO_REMAT_MIN_TOKENS
    config = get_preset("tiny", remat="auto", n_layers=1)
    assert config.remat == "auto"

    def jaxpr(shape):
        graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(4)))
        loss = lambda s, t: jnp.sum(nnx.merge(graphdef, s)(t).logits)  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(loss))(state, jnp.zeros(shape, jnp.int32)))

    short = jaxpr((1, AUTO_REMAT_MIN_TOKENS // 2))
    long = jaxpr((2, AUTO_REMAT_MIN_TOKENS // 2))  # exactly the threshold
    assert "checkpoint" not in short and "remat" not in short
    assert "checkpoint" in long or "remat" in long
