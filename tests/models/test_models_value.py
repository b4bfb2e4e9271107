"""Value model: from a policy (same trunk, independent copy) or from scratch."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rljax.models as models


def test_value_model_from_policy_and_scratch(tiny_config):
    policy = models.Decoder(tiny_config, rngs=nnx.Rngs(0))
    critic = models.ValueModel.from_policy(policy)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 256)
    mask = jnp.arange(6)[None, :] < jnp.array([[6], [4]])

    values = nnx.jit(lambda m, t, k: m(t, attn_mask_BxT=k))(critic, tokens, mask)
    assert values.shape == (2, 6) and values.dtype == jnp.float32
    np.testing.assert_array_equal(values, 0.0)  # zero head

    # The trunk is the policy's: a head equal to an unembedding row gives that logit.
    critic.head[...] = policy.unembed_weight()[7]
    values = nnx.jit(lambda m, t, k: m(t, attn_mask_BxT=k))(critic, tokens, mask)
    logits = nnx.jit(lambda m, t, k: m(t, attn_mask_BxT=k).logits)(policy, tokens, mask)
    np.testing.assert_allclose(values, logits[..., 7], atol=1e-5)

    # Training the critic's trunk leaves the policy untouched (a copy, not shared arrays).
    def loss(critic):
        return jnp.mean((critic(tokens) - 1.0) ** 2)

    grads = nnx.jit(nnx.grad(loss))(critic)
    assert float(jnp.abs(grads.trunk.layers.mlp.up[...][0]).max()) > 0
    before = np.asarray(policy.embed[...]).copy()
    critic.trunk.embed[...] = critic.trunk.embed[...] + 1.0
    np.testing.assert_array_equal(policy.embed[...], before)

    scratch = models.ValueModel(tiny_config, rngs=nnx.Rngs(3))
    assert not np.allclose(scratch.trunk.embed[...], policy.embed[...])
    assert set(models.__all__) >= {"Decoder", "ValueModel", "load_pretrained", "token_logprobs",
                                   "sequence_logprobs", "init_cache", "get_preset", "Tokenizer"}
