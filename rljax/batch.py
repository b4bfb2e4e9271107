"""The TrainBatch contract: what one jitted train step consumes.

Every field is `[B, T]` and right-padded unless noted. The step never reads an
algorithm name: advantages and the normalizer coefficients of each loss
component arrive as data, computed over the whole optimizer-step batch before
it is split into micro-batches or sharded (DESIGN.md, "Normalizers are data").
"""

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class TrainBatch:
    """One optimizer step's rows.

    tokens: int32 token ids (prompt, completion, environment tokens).
    positions: int32 position ids.
    loss_mask: 1 on completion tokens that train with the `rl` component.
    behavior_logp: float32 log-probs the sampler recorded for each token.
    advantages: float32 per-token advantages (row advantages broadcast).
    coef: float32 axis-2 coefficients of the `rl` component.
    old_logp: trainer log-probs at the start of the batch (None: use mu).
    ref_logp: frozen reference model's log-probs (KL).
    teacher_logp: a teacher's log-probs for the `ref_kl` component (OPD).
    ce_coef: weight times coefficient of the `ce` component (SFT, echo).
    ref_kl_coef: weight times coefficient of the `ref_kl` component.
    routing: int32 [B, T, layers, k] MoE expert indices to replay.
    policy_version: int32 [B] weights version that sampled each row.
    group_id: int32 [B] prompt group of each row.
    returns: GAE value targets for PPO's critic.
    old_values: the critic's values before the update (value clipping).
    """

    tokens: jax.Array
    positions: jax.Array
    loss_mask: jax.Array
    behavior_logp: jax.Array
    advantages: jax.Array
    coef: jax.Array
    old_logp: Optional[jax.Array] = None
    ref_logp: Optional[jax.Array] = None
    teacher_logp: Optional[jax.Array] = None
    ce_coef: Optional[jax.Array] = None
    ref_kl_coef: Optional[jax.Array] = None
    routing: Optional[jax.Array] = None
    policy_version: Optional[jax.Array] = None
    group_id: Optional[jax.Array] = None
    returns: Optional[jax.Array] = None
    old_values: Optional[jax.Array] = None

    @property
    def shape(self):
        return tuple(self.tokens.shape)

    def validate(self) -> "TrainBatch":
        """Checks every field against `tokens` and returns self.

        Raises ValueError naming the field, its shape and the expected shape;
        also rejects non-finite advantages or coefficients (a NaN there would
        silently poison the whole step).
        """
        if np.ndim(self.tokens) != 2:
            raise ValueError(f"tokens must be [B, T], got {np.shape(self.tokens)}")
        bt = tuple(np.shape(self.tokens))
        for name in ("positions", "loss_mask", "behavior_logp", "advantages",
                     "coef", "old_logp", "ref_logp", "teacher_logp", "ce_coef",
                     "ref_kl_coef", "returns", "old_values"):
            v = getattr(self, name)
            if v is not None and tuple(np.shape(v)) != bt:
                raise ValueError(f"TrainBatch.{name} has shape {np.shape(v)}, "
                                 f"expected {bt} like tokens")
        for name in ("policy_version", "group_id"):
            v = getattr(self, name)
            if v is not None and tuple(np.shape(v)) != bt[:1]:
                raise ValueError(f"TrainBatch.{name} has shape {np.shape(v)}, "
                                 f"expected {bt[:1]}")
        if self.routing is not None and tuple(np.shape(self.routing))[:2] != bt:
            raise ValueError(f"TrainBatch.routing has shape {np.shape(self.routing)}, "
                             f"expected {bt} + (layers, k)")
        for name in ("advantages", "coef", "ce_coef", "ref_kl_coef"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, jax.core.Tracer):
                if not np.all(np.isfinite(np.asarray(v))):
                    raise ValueError(f"TrainBatch.{name} has non-finite values")
        return self

    def split(self, k: int) -> "TrainBatch":
        """Rows split into k micro-batches: every leaf gets a leading [k] axis."""
        b = self.tokens.shape[0]
        if k < 1 or b % k:
            raise ValueError(f"cannot split {b} rows into {k} micro-batches")
        return jax.tree.map(lambda x: x.reshape((k, b // k) + x.shape[1:]), self)

    def rows(self, index) -> "TrainBatch":
        """The rows at `index` (a slice or an index array) of every field."""
        return jax.tree.map(lambda x: x[index], self)


def on_policy_batch(tokens, loss_mask, advantages, coef, logp=None) -> TrainBatch:
    """A batch whose behavior log-probs are `logp` (zeros when omitted)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    logp = jnp.zeros((b, t), jnp.float32) if logp is None else logp
    return TrainBatch(
        tokens=tokens,
        positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        loss_mask=jnp.asarray(loss_mask, jnp.float32),
        behavior_logp=jnp.asarray(logp, jnp.float32),
        advantages=jnp.asarray(advantages, jnp.float32),
        coef=jnp.asarray(coef, jnp.float32),
    )
