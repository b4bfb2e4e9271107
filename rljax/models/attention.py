"""Attention kernels with one masking rule: causal, padding and packed segments, grouped-query heads.

    out[b, i, h] = sum_j softmax_j(q[b, i, h] . k[b, j, h // G] * scale | visible) v[b, j, h // G]

where key j is visible to query i iff

    kv_valid[b, j]  and  q_segment_ids[b, i] == kv_segment_ids[b, j]  and  (not causal or j <= i)

(j <= i compares row indices; with `q_positions` / `kv_positions` it compares
those instead, which is how queries attend over a KV cache's slots). A query
that sees no key (padding) gets an output of exactly zero and passes no
gradient, in every implementation that can express it.

Implementations (`implementation=`):

- `xla`: einsum attention that materialises the [B, H, T, S] scores; the
  reference, and the one-query KV-cache decode path ([B, H, S] scores).
- `blockwise`: online softmax over key blocks (flash attention, Dao 2023,
  arXiv:2307.08691) in pure JAX, with a custom VJP that also runs block by
  block from the output and the log-sum-exp, so memory is O(T x block) on
  every backend. Causal blocks above the diagonal are skipped in both passes.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` on NVIDIA
  GPUs (bfloat16 / float16). Padding goes in as key lengths, so `kv_valid`
  must be right padding (True then False along each row); it has no segment
  ids, so packed rows are refused.
- `splash`: the Pallas TPU splash-attention kernel, with causal block
  sparsity; padding is folded into its segment ids.
- `auto`: splash on TPU, cudnn on NVIDIA GPUs when the dtype, head size and
  masks allow, else blockwise from `AUTO_BLOCKWISE_MIN_LEN` queries and xla
  below. Each distinct choice is logged once (logger "rljax.models").
"""

from __future__ import annotations

import functools
import logging
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cudnn", "splash")
# From this many queries `auto` prefers blockwise to xla: at 1024 the xla
# scores of one smollm2 layer are already 9 x 1024^2 x 4 B = 36 MiB per row.
AUTO_BLOCKWISE_MIN_LEN = 1024
DEFAULT_BLOCK = 512

# A finite "minus infinity" for masked scores (exp underflows to exactly 0,
# and max/subtract never overflow). _BIG is the log-sum-exp given to rows that
# see nothing, so the backward's exp(masked - lse) is 0 there too.
_NEG = -0.7 * float(np.finfo(np.float32).max)
_BIG = -_NEG
_SPLASH_LANES = 128  # splash blocks are multiples of the TPU lane width
_NO_SEGMENT = int(np.iinfo(np.int32).min)  # splash: the segment of padding keys

log = logging.getLogger("rljax.models")
_logged: set[tuple[str, str]] = set()


def _log_once(chosen: str, reason: str) -> None:
    if (chosen, reason) not in _logged:
        _logged.add((chosen, reason))
        log.info("attention implementation: %s (%s)", chosen, reason)


# ----------------------------------------------------------------------------
# Choosing an implementation.


def backend_kind() -> str:
    """"tpu", "nvidia" (a CUDA GPU), "gpu" (another GPU) or "cpu"."""
    platform = jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        device = jax.devices()[0]
        version = getattr(device.client, "platform_version", "") or ""
        nvidia = "cuda" in version.lower() or "nvidia" in device.device_kind.lower()
        return "nvidia" if nvidia else "gpu"
    return platform


def _cudnn_problem(backend, dtype, head_dim, segments, positions) -> str | None:
    if backend != "nvidia":
        return f"needs an NVIDIA GPU (cuDNN), but the backend is {backend!r}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs compute_dtype bfloat16 or float16 (cuDNN flash attention), got {jnp.dtype(dtype).name}"
    if head_dim > 128 or head_dim % 8:
        return f"needs head_dim <= 128 and a multiple of 8, got {head_dim}"
    if segments:
        return "takes no segment ids (jax.nn.dot_product_attention has none), so it cannot run packed rows"
    if positions:
        return "cannot attend over KV-cache slots by position"
    return None


def _splash_problem(backend, dtype, head_dim, segments, positions) -> str | None:
    del dtype, head_dim, segments
    if backend != "tpu":
        return f"needs a TPU (Pallas splash attention), but the backend is {backend!r}"
    if positions:
        return "cannot attend over KV-cache slots by position"
    return None


def choose(requested: str, *, q_len: int, dtype, head_dim: int, segments: bool = False,
           positions: bool = False, backend: str | None = None, field: str = "implementation") -> str:
    """The implementation that runs for `requested` on this backend, logged once per distinct choice.

    Args:
      requested: one of IMPLEMENTATIONS.
      q_len: queries per row (auto: blockwise from AUTO_BLOCKWISE_MIN_LEN).
      dtype, head_dim: of q / k / v (cuDNN needs 16-bit floats).
      segments: packed rows (segment ids) are present.
      positions: causality is by explicit positions (attention over a KV cache).
      backend: override of backend_kind() (tests).
      field: the name used in errors, e.g. "ModelConfig.attention".

    Raises:
      ValueError: an unknown name, or cudnn / splash where they cannot run.
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"{field}={requested!r}; valid: {', '.join(IMPLEMENTATIONS)}")
    backend = backend_kind() if backend is None else backend
    problems = {"cudnn": _cudnn_problem, "splash": _splash_problem}
    if requested in problems:
        problem = problems[requested](backend, dtype, head_dim, segments, positions)
        if problem:
            raise ValueError(f"{field}={requested!r} {problem}; use 'auto', 'blockwise' or 'xla'")
        chosen, reason = requested, "requested"
    elif requested != "auto":
        chosen, reason = requested, "one query over a KV cache" if positions and q_len == 1 else "requested"
    else:
        kernel = {"tpu": "splash", "nvidia": "cudnn"}.get(backend)
        problem = problems[kernel](backend, dtype, head_dim, segments, positions) if kernel else None
        if kernel and not problem:
            chosen, reason = kernel, f"auto on {backend}"
        else:
            long = q_len >= AUTO_BLOCKWISE_MIN_LEN
            chosen = "blockwise" if long else "xla"
            reason = (f"auto on {backend}, {'>=' if long else '<'} {AUTO_BLOCKWISE_MIN_LEN} queries"
                      + (f"; {kernel} {problem}" if kernel else ""))
    _log_once(chosen, reason)
    return chosen


# ----------------------------------------------------------------------------
# Masks shared by xla and blockwise.


def _visible(q_seg_BxQ, q_pos_BxQ, kv_seg_BxK, kv_pos_BxK, kv_valid_BxK, causal):
    """[B, 1, 1, Q, K] bool: key visible to query (the rule of the module docstring)."""
    vis = kv_valid_BxK[:, None, :] & (q_seg_BxQ[:, :, None] == kv_seg_BxK[:, None, :])
    if causal:
        vis = vis & (kv_pos_BxK[:, None, :] <= q_pos_BxQ[:, :, None])
    return vis[:, None, None]


def _xla(q5, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal, scale):
    """Materialised scores; q5 is [B, T, KV, G, Dh] (G query heads per key head, no repeated K/V)."""
    s = jnp.einsum("btkgd,bskd->bkgts", q5, k, preferred_element_type=jnp.float32) * scale
    vis = _visible(q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal)
    s = jnp.where(vis, s, _NEG)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    # Second where: a row that sees nothing sums to 0 (output 0), not to a uniform average.
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)


# ----------------------------------------------------------------------------
# Blockwise (flash) attention. Hand-written: no JAX library ships a pure-JAX
# flash attention with segment ids and a blockwise backward that runs on CPU.


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x, update, start, axis):
    return jax.lax.dynamic_update_slice_in_dim(x, update, start, axis=axis)


def _flash_forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal, skip, bq, bk, scale):
    """(out [B, Tp, KV, G, Dh], lse [B, KV, G, Tp] float32), one [B, KV, G, bq, bk] score block at a time."""
    B, Tp, KV, G, Dh = q.shape
    nq, nk = Tp // bq, k.shape[1] // bk

    def q_block(i, carry):
        out, lse = carry
        qi = _slice(q, i * bq, bq, 1)
        qs, qp = _slice(q_seg, i * bq, bq, 1), _slice(q_pos, i * bq, bq, 1)

        def kv_block(j, acc_carry):
            m, l, acc = acc_carry
            kj, vj = _slice(k, j * bk, bk, 1), _slice(v, j * bk, bk, 1)
            vis = _visible(qs, qp, _slice(kv_seg, j * bk, bk, 1), _slice(kv_pos, j * bk, bk, 1),
                           _slice(kv_valid, j * bk, bk, 1), causal)
            s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
            s = jnp.where(vis, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l, acc * alpha[..., None] + pv

        init = (jnp.full((B, KV, G, bq), _NEG, jnp.float32), jnp.zeros((B, KV, G, bq), jnp.float32),
                jnp.zeros((B, KV, G, bq, Dh), jnp.float32))
        # Causal, index order: key blocks past the diagonal are invisible to every query of block i.
        n_kv = jnp.minimum(nk, ((i + 1) * bq + bk - 1) // bk) if skip else nk
        m, l, acc = jax.lax.fori_loop(0, n_kv, kv_block, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        out = _put(out, jnp.transpose(o, (0, 3, 1, 2, 4)).astype(q.dtype), i * bq, 1)
        lse = _put(lse, jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), _BIG), i * bq, 3)
        return out, lse

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros((B, KV, G, Tp), jnp.float32))
    return jax.lax.fori_loop(0, nq, q_block, init)


def _flash_backward(res, dout, causal, skip, bq, bk, scale):
    """dq, dk, dv from the saved output and log-sum-exp, recomputing one score block at a time."""
    q, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, out, lse = res
    Tp, S = q.shape[1], k.shape[1]
    nq, nk = Tp // bq, S // bk
    delta = jnp.einsum("btkgd,btkgd->bkgt", dout.astype(jnp.float32), out.astype(jnp.float32))

    def kv_block(j, carry):
        dq, dk, dv = carry
        kj, vj = _slice(k, j * bk, bk, 1), _slice(v, j * bk, bk, 1)
        ks, kp, kvv = _slice(kv_seg, j * bk, bk, 1), _slice(kv_pos, j * bk, bk, 1), _slice(kv_valid, j * bk, bk, 1)

        def q_block(i, inner):
            dq, dkj, dvj = inner
            qi, doi = _slice(q, i * bq, bq, 1), _slice(dout, i * bq, bq, 1)
            lse_i, delta_i = _slice(lse, i * bq, bq, 3), _slice(delta, i * bq, bq, 3)
            vis = _visible(_slice(q_seg, i * bq, bq, 1), _slice(q_pos, i * bq, bq, 1), ks, kp, kvv, causal)
            s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
            # Masked scores and rows that see nothing both give exp(very negative) = 0.
            p = jnp.exp(jnp.where(vis, s, _NEG) - lse_i[..., None])
            dvj = dvj + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doi.dtype), doi,
                                   preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None])
            dkj = dkj + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qi.dtype), qi,
                                   preferred_element_type=jnp.float32) * scale
            dqi = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)
            dq = _put(dq, _slice(dq, i * bq, bq, 1) + dqi * scale, i * bq, 1)
            return dq, dkj, dvj

        first = (j * bk) // bq if skip else 0  # query blocks above the diagonal see no key of block j
        zeros = jnp.zeros(kj.shape, jnp.float32)
        dq, dkj, dvj = jax.lax.fori_loop(first, nq, q_block, (dq, zeros, zeros))
        return dq, _put(dk, dkj, j * bk, 1), _put(dv, dvj, j * bk, 1)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, nk, kv_block, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _flash(q, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal, skip, bq, bk, scale):
    return _flash_forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal, skip, bq, bk, scale)[0]


def _flash_fwd(q, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal, skip, bq, bk, scale):
    out, lse = _flash_forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal, skip, bq, bk, scale)
    return out, (q, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, out, lse)


def _flash_bwd(causal, skip, bq, bk, scale, res, dout):
    dq, dk, dv = _flash_backward(res, dout, causal, skip, bq, bk, scale)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x, length, axis, value=0):
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _blockwise(q5, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal, skip, block_q, block_kv, scale):
    T, S = q5.shape[1], k.shape[1]
    bq, bk = min(block_q, T), min(block_kv, S)
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    # Padded keys are invalid; padded queries are computed and dropped.
    q5, q_seg, q_pos = _pad_to(q5, Tp, 1), _pad_to(q_seg, Tp, 1), _pad_to(q_pos, Tp, 1)
    k, v, kv_seg, kv_pos = _pad_to(k, Sp, 1), _pad_to(v, Sp, 1), _pad_to(kv_seg, Sp, 1), _pad_to(kv_pos, Sp, 1)
    kv_valid = _pad_to(kv_valid, Sp, 1, False)
    out = _flash(q5, k, v, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal, skip, bq, bk, scale)
    return out[:, :T]


# ----------------------------------------------------------------------------
# Accelerator kernels.


def cudnn_attention(q_BxTxHxDh, k_BxSxKVxDh, v_BxSxKVxDh, *, kv_valid_BxS=None, causal=True, scale=None,
                    sdpa_implementation: str = "cudnn"):
    """cuDNN flash attention through `jax.nn.dot_product_attention`; padding as key lengths.

    `kv_valid_BxS` must be right padding: its count per row is passed as
    `key_value_seq_lengths` (at least 1, so a row without keys stays finite).
    `sdpa_implementation="xla"` runs the same arguments through JAX's own
    reference path (how the argument construction is tested off-GPU).
    """
    kwargs = {}
    if kv_valid_BxS is not None:
        kwargs["key_value_seq_lengths"] = jnp.maximum(jnp.sum(kv_valid_BxS, axis=1), 1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q_BxTxHxDh, k_BxSxKVxDh, v_BxSxKVxDh, scale=scale, is_causal=causal,
                                        implementation=sdpa_implementation, **kwargs)


def _splash_block(block: int, length: int) -> int:
    lanes = -(-length // _SPLASH_LANES) * _SPLASH_LANES
    return max(_SPLASH_LANES, min(block // _SPLASH_LANES * _SPLASH_LANES, lanes))


def splash_attention(q_BxTxHxDh, k_BxSxKVxDh, v_BxSxKVxDh, *, q_segment_ids_BxT=None, kv_segment_ids_BxS=None,
                     kv_valid_BxS=None, causal=True, scale=None, block_q=DEFAULT_BLOCK, block_kv=DEFAULT_BLOCK,
                     interpret: bool = False):
    """The Pallas TPU splash kernel (vmapped over rows), with padding folded into segment ids.

    Invalid keys get a segment id no query has, so the rule of the module
    docstring holds exactly; a query that sees no key gets a finite average
    (the kernel has no empty rows) instead of zero. T and S are padded to a
    multiple of the block (a multiple of 128). `interpret=True` runs the kernel
    in the Pallas interpreter (any backend; tests).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, H, Dh = q_BxTxHxDh.shape
    S = k_BxSxKVxDh.shape[1]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    if causal and S != T:
        raise ValueError(f"causal splash attention needs as many keys as queries, got {T} and {S}")
    bq, bk = _splash_block(block_q, T), _splash_block(block_kv, S)
    if causal:  # one padded length that both block sizes divide
        Tp = Sp = -(-T // math.lcm(bq, bk)) * math.lcm(bq, bk)
    else:
        Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    q_seg = jnp.zeros((B, T), jnp.int32) if q_segment_ids_BxT is None else q_segment_ids_BxT.astype(jnp.int32)
    kv_seg = jnp.zeros((B, S), jnp.int32) if kv_segment_ids_BxS is None else kv_segment_ids_BxS.astype(jnp.int32)
    if kv_valid_BxS is not None:
        kv_seg = jnp.where(kv_valid_BxS, kv_seg, _NO_SEGMENT)
    q_seg, kv_seg = _pad_to(q_seg, Tp, 1), _pad_to(kv_seg, Sp, 1, _NO_SEGMENT)
    q = _pad_to(q_BxTxHxDh * jnp.asarray(scale, q_BxTxHxDh.dtype), Tp, 1).transpose(0, 2, 1, 3)
    k = _pad_to(k_BxSxKVxDh, Sp, 1).transpose(0, 2, 1, 3)
    v = _pad_to(v_BxSxKVxDh, Sp, 1).transpose(0, 2, 1, 3)
    base = splash.CausalMask((Tp, Sp)) if causal else splash.FullMask((Tp, Sp))
    sizes = splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                              block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    kernel = splash.make_splash_mha(splash.MultiHeadMask([base] * H), block_sizes=sizes, head_shards=1,
                                    q_seq_shards=1, interpret=interpret)
    out = jax.vmap(kernel)(q, k, v, splash.SegmentIds(q=q_seg, kv=kv_seg))
    return out.transpose(0, 2, 1, 3)[:, :T]


# ----------------------------------------------------------------------------
# The entry point.


def attention(q_BxTxHxDh: jax.Array, k_BxSxKVxDh: jax.Array, v_BxSxKVxDh: jax.Array, *,
              q_segment_ids_BxT: jax.Array | None = None, kv_segment_ids_BxS: jax.Array | None = None,
              kv_valid_BxS: jax.Array | None = None, q_positions_BxT: jax.Array | None = None,
              kv_positions_BxS: jax.Array | None = None, causal: bool = True, implementation: str = "auto",
              block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK, scale: float | None = None,
              field: str = "implementation") -> jax.Array:
    """Grouped-query attention [B, T, H, Dh] under the masking rule of the module docstring.

    Args:
      q_BxTxHxDh, k_BxSxKVxDh, v_BxSxKVxDh: H a multiple of KV; query head h reads key head h // (H / KV).
      q_segment_ids_BxT, kv_segment_ids_BxS: int ids of packed sequences (both or neither).
      kv_valid_BxS: False on padding keys (default all True).
      q_positions_BxT, kv_positions_BxS: causal order by position instead of row index (both or
        neither; xla and blockwise only, for attention over a KV cache).
      causal: apply the causal rule.
      implementation: one of IMPLEMENTATIONS.
      block_q, block_kv: blockwise / splash tile sizes.
      scale: score scale, default 1 / sqrt(Dh).
      field: how errors name `implementation` (the Decoder passes "ModelConfig.attention").

    Returns:
      [B, T, H, Dh] in q's dtype.
    """
    chex.assert_rank([q_BxTxHxDh, k_BxSxKVxDh, v_BxSxKVxDh], 4)
    B, T, H, Dh = q_BxTxHxDh.shape
    S, KV = k_BxSxKVxDh.shape[1], k_BxSxKVxDh.shape[2]
    chex.assert_shape([k_BxSxKVxDh, v_BxSxKVxDh], (B, S, KV, Dh))
    if H % KV:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({KV})")
    if (q_segment_ids_BxT is None) != (kv_segment_ids_BxS is None):
        raise ValueError("give both q_segment_ids_BxT and kv_segment_ids_BxS, or neither")
    if (q_positions_BxT is None) != (kv_positions_BxS is None):
        raise ValueError("give both q_positions_BxT and kv_positions_BxS, or neither")
    for name, x, shape in (("q_segment_ids_BxT", q_segment_ids_BxT, (B, T)),
                           ("kv_segment_ids_BxS", kv_segment_ids_BxS, (B, S)),
                           ("kv_valid_BxS", kv_valid_BxS, (B, S)), ("q_positions_BxT", q_positions_BxT, (B, T)),
                           ("kv_positions_BxS", kv_positions_BxS, (B, S))):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")
    if block_q < 1 or block_kv < 1:
        raise ValueError(f"block_q and block_kv must be positive, got {block_q}, {block_kv}")
    segments, positions = q_segment_ids_BxT is not None, q_positions_BxT is not None
    impl = choose(implementation, q_len=T, dtype=q_BxTxHxDh.dtype, head_dim=Dh, segments=segments,
                  positions=positions, field=field)
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)

    if impl == "cudnn":
        return cudnn_attention(q_BxTxHxDh, k_BxSxKVxDh, v_BxSxKVxDh, kv_valid_BxS=kv_valid_BxS, causal=causal,
                               scale=scale)
    if impl == "splash":
        return splash_attention(q_BxTxHxDh, k_BxSxKVxDh, v_BxSxKVxDh, q_segment_ids_BxT=q_segment_ids_BxT,
                                kv_segment_ids_BxS=kv_segment_ids_BxS, kv_valid_BxS=kv_valid_BxS, causal=causal,
                                scale=scale, block_q=block_q, block_kv=block_kv)

    zeros_T, zeros_S = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    q_seg = zeros_T if q_segment_ids_BxT is None else q_segment_ids_BxT.astype(jnp.int32)
    kv_seg = zeros_S if kv_segment_ids_BxS is None else kv_segment_ids_BxS.astype(jnp.int32)
    kv_valid = jnp.ones((B, S), bool) if kv_valid_BxS is None else kv_valid_BxS.astype(bool)
    if positions:
        q_pos, kv_pos = q_positions_BxT.astype(jnp.int32), kv_positions_BxS.astype(jnp.int32)
    else:
        q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    q5 = q_BxTxHxDh.reshape(B, T, KV, H // KV, Dh)
    args = (q5, k_BxSxKVxDh, v_BxSxKVxDh, q_seg, q_pos, kv_seg, kv_pos, kv_valid, causal)
    if impl == "xla":
        out = _xla(*args, scale)
    else:
        # Index order makes the causal block structure static, so skipped blocks are known.
        out = _blockwise(*args, causal and not positions, block_q, block_kv, scale)
    return out.reshape(B, T, H, Dh)
