"""PPO's critic: the decoder trunk with a scalar head, V(tokens[:t+1]) at every position."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.transformer import Decoder


class ValueModel(nnx.Module):
    """values[b, t] = w . hidden[b, t] + c, the value of the prefix tokens[b, :t+1].

    Built from scratch (`ValueModel(config, rngs=...)`) or from a policy
    (`ValueModel.from_policy(policy)`: a copy of its trunk, so training the
    critic never changes the policy). The head starts at zero, so initial
    values are 0 whatever the trunk. The trunk's unembedding is kept but unused.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None, trunk: Decoder | None = None):
        self.config = config
        self.trunk = trunk if trunk is not None else Decoder(config, rngs=rngs)
        self.head = nnx.Param(jnp.zeros((config.d_model,), jnp.float32), sharding_names=("embed",),
                              eager_sharding=False)
        self.head_bias = nnx.Param(jnp.zeros((), jnp.float32))

    @classmethod
    def from_policy(cls, policy: Decoder) -> ValueModel:
        graphdef, state = nnx.split(policy)
        trunk = nnx.merge(graphdef, jax.tree_util.tree_map(jnp.copy, state))
        return cls(policy.config, trunk=trunk)

    def __call__(self, tokens_BxT, positions_BxT=None, *, attn_mask_BxT=None, segment_ids_BxT=None,
                 routing_BxTxLxK=None):
        """Float32 values [B, T]; same arguments as `Decoder.__call__`."""
        out = self.trunk(tokens_BxT, positions_BxT, attn_mask_BxT=attn_mask_BxT, segment_ids_BxT=segment_ids_BxT,
                         routing_BxTxLxK=routing_BxTxLxK, return_hidden=True)
        hidden = out.hidden.astype(jnp.float32)
        return jnp.einsum("btd,d->bt", hidden, self.head[...]) + self.head_bias[...]
