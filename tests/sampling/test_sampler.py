"""InProcessSampler: behavior log-probs vs. the trainer's, greedy vs. cache-free argmax, filtering,
stops, seeds, MoE routing, length buckets without recompilation, weight swaps (continuous batching
against static: tests/sampling/test_continuous.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models.config import get_preset
from rljax.models.logprobs import sequence_logprobs
from rljax.models.transformer import Decoder
from rljax.sampling import Completion, InProcessSampler, Sampler, SamplingParams
from rljax.sampling import decode as decode_lib

PROMPTS = [[5, 17, 33], [9, 2, 40, 41, 77, 3], [100]]
# One batch, prompt and completion bucket: most tests share two compiled programs.
BUCKETS = dict(prompt_buckets=(16,), completion_buckets=(16,), max_batch=8, batch_buckets=(8,))
GRID = 32  # reference forwards run on [B, 32] right-padded grids: one compilation each


def sharp_model(name="tiny", seed=0, scale=8.0):
    """A random decoder with weights scaled up: at init it is nearly uniform and greedily
    repeats its input; scaled, its predictions are sharp and vary (a stronger test)."""
    model = Decoder(get_preset(name), rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state))
    return model


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@pytest.fixture(scope="module")
def sampler(model):
    return InProcessSampler(model, **BUCKETS)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _jit_logits(graphdef, state, tokens_BxT):
    return nnx.merge(graphdef, state)(tokens_BxT).logits


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _jit_seq_logprobs(graphdef, state, tokens_BxT, mask_BxT, routing, temperature):
    return sequence_logprobs(nnx.merge(graphdef, state), tokens_BxT, attn_mask_BxT=mask_BxT,
                             routing_BxTxLxK=routing, temperature=temperature)


def _padded(seqs):
    tokens = np.zeros((len(seqs), GRID), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    mask = np.arange(GRID)[None, :] < np.array([len(s) for s in seqs])[:, None]
    return tokens, mask


def _trainer_logprobs(model, completions, temperature, routing=None):
    """The trainer's side: sequence_logprobs on right-padded prompt + completion rows."""
    tokens, mask = _padded([c.prompt_ids + c.completion_ids for c in completions])
    logp = np.asarray(_jit_seq_logprobs(*nnx.split(model), tokens, mask, routing, jnp.float32(temperature)))
    return [logp[b, len(c.prompt_ids):len(c.prompt_ids) + len(c.completion_ids)] for b, c in enumerate(completions)]


def _next_logits(model, ids):
    """Float64 logits after `ids`, from a full forward without a cache."""
    tokens, _ = _padded([ids])
    return np.asarray(_jit_logits(*nnx.split(model), tokens)[0, len(ids) - 1], np.float64)


def test_protocol_and_params_validation(sampler):
    assert isinstance(sampler, Sampler)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got -2"):
        SamplingParams(max_new_tokens=-2)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(max_new_tokens=4, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(max_new_tokens=4, temperature=float("nan"))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate([[1], []], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"outside \[0, 256\)"):
        sampler.generate([[1, 256]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="prompt of length 17 is longer than the largest bucket 16"):
        sampler.generate([[1] * 17], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="exceeds the model's context of 256 tokens"):
        InProcessSampler(sampler.model()).generate([[1] * 200], SamplingParams(max_new_tokens=100))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_equal_trainer_logprobs(model, sampler, temperature):
    params = SamplingParams(max_new_tokens=12, temperature=temperature, n=2, seed=1, stop_token_ids=(7, 11))
    out = sampler.generate(PROMPTS, params)
    assert len(out) == 6 and all(isinstance(c, Completion) for c in out)
    assert [c.prompt_ids for c in out] == [p for p in PROMPTS for _ in range(2)]  # prompt-major groups
    assert all(c.version == 0 and c.routing is None for c in out)
    trainer = _trainer_logprobs(model, out, temperature)
    for c, ref in zip(out, trainer):
        assert len(c.logprobs) == len(c.completion_ids) >= 1
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4)
    # The comparison can fail: the trainer at another temperature disagrees.
    other = _trainer_logprobs(model, out, temperature + 0.5)
    assert max(np.abs(np.asarray(c.logprobs) - o).max() for c, o in zip(out, other)) > 1e-2


def test_greedy_equals_argmax_without_cache(model, sampler):
    out = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0))
    for c in out:
        ids = list(c.prompt_ids)
        for _ in range(10):  # no cache: the whole prefix again every step
            ids.append(int(np.argmax(_next_logits(model, ids))))
        assert c.completion_ids == ids[len(c.prompt_ids):]
        assert c.finish_reason == "length"
        # Greedy records the untempered, untruncated log-prob.
        ref = _trainer_logprobs(model, [c], 1.0)[0]
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4)


def test_stop_token_is_last_and_included(sampler):
    greedy = sampler.generate([PROMPTS[1]], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
    stop = greedy.completion_ids[3]
    first = greedy.completion_ids.index(stop)
    out = sampler.generate([PROMPTS[1]], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                        stop_token_ids=(255, stop)))[0]
    assert out.finish_reason == "stop"
    # Token 0 comes from the prefill, tokens 1..first from one decode step each: the loop exited early.
    assert sampler.last_timing["decode_steps"] == first < 16
    assert out.completion_ids == greedy.completion_ids[:first + 1]
    np.testing.assert_allclose(out.logprobs, greedy.logprobs[:first + 1], atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_filter_logits_golden(jit):
    # probs .5 .3 .15 .05 (row order shuffled to test the sort).
    logits = jnp.log(jnp.asarray([[0.3, 0.05, 0.5, 0.15]] * 4, jnp.float32))
    top_k = jnp.asarray([0, 1, 3, 3], jnp.int32)
    top_p = jnp.asarray([0.7, 1.0, 0.9, 0.8], jnp.float32)
    fn = jax.jit(decode_lib.filter_logits) if jit else decode_lib.filter_logits
    kept = np.isfinite(np.asarray(fn(logits, top_k, top_p)))
    expected = np.array([
        [1, 0, 1, 0],  # top-p .7: mass before .5, .3 is 0 and .5 -> keep two
        [0, 0, 1, 0],  # top-k 1
        [1, 0, 1, 1],  # top-3 renormalised .526 .316 .158: mass before 0 .526 .842 < .9 -> all three
        [1, 0, 1, 0],  # ... < .8 -> two
    ], bool)
    np.testing.assert_array_equal(kept, expected)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (20, 0.9)])
def test_truncated_logprobs_are_renormalised(model, sampler, top_k, top_p):
    T = 0.8
    params = SamplingParams(max_new_tokens=4, temperature=T, top_k=top_k, top_p=top_p, n=2, seed=7)
    for c in sampler.generate(PROMPTS[:2], params):
        for j, tok in enumerate(c.completion_ids):
            z = _next_logits(model, c.prompt_ids + c.completion_ids[:j]) / T
            p = np.exp(z - z.max())
            p /= p.sum()
            order = np.argsort(-p)
            k = top_k or len(p)
            pk = np.zeros_like(p)
            pk[order[:k]] = p[order[:k]]
            pk /= pk.sum()
            sorted_p = pk[order]
            n_keep = max(1, int(np.sum((np.cumsum(sorted_p) - sorted_p) < top_p)))
            q = np.zeros_like(p)
            q[order[:n_keep]] = pk[order[:n_keep]]
            q /= q.sum()
            assert q[tok] > 0, "sampled a token outside the top-k / top-p set"
            np.testing.assert_allclose(c.logprobs[j], np.log(q[tok]), atol=1e-4)
            assert c.logprobs[j] > np.log(p[tok]) + 1e-6  # truncation really renormalised


def test_seed_reproducible_and_rows_independent(sampler):
    params = SamplingParams(max_new_tokens=8, n=2, seed=11)
    a = sampler.generate(PROMPTS, params)
    b = sampler.generate(PROMPTS, params)
    assert [c.completion_ids for c in a] == [c.completion_ids for c in b]
    c = sampler.generate(PROMPTS, params.replace(seed=12))
    assert [x.completion_ids for x in a] != [x.completion_ids for x in c]
    assert a[0].completion_ids != a[1].completion_ids  # a group's samples differ
    # A row's stream depends on (seed, row id) only, not on the other rows in the batch.
    alone = sampler.generate(PROMPTS[:1], params)
    assert [x.completion_ids for x in alone] == [x.completion_ids for x in a[:2]]


def test_more_rows_than_max_batch(model, sampler):
    # 9 rows in batches of at most 4 (a [4, 4, 1] split, each padded to 4), against batches of 8 + 1.
    small = InProcessSampler(model, **{**BUCKETS, "max_batch": 4, "batch_buckets": (4,)})
    params = SamplingParams(max_new_tokens=5, n=3, seed=2)
    a, b = small.generate(PROMPTS, params), sampler.generate(PROMPTS, params)
    assert len(a) == 9 and [x.completion_ids for x in a] == [x.completion_ids for x in b]


def test_moe_routing_matches_full_forward():
    model = sharp_model("tiny-moe", seed=3)
    sampler = InProcessSampler(model, **BUCKETS)
    out = sampler.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, temperature=0.9, seed=4))
    L, K = model.config.n_layers, model.config.experts_per_token
    for c in out:
        n, m = len(c.prompt_ids), len(c.completion_ids)
        assert c.routing.shape == (m, L, K) and c.routing.dtype == np.int32
        tokens, _ = _padded([c.prompt_ids + c.completion_ids])
        full = np.asarray(model(jnp.asarray(tokens)).routing[0])
        # routing[j] produced logprobs[j]: the forward of the input token before completion token j.
        np.testing.assert_array_equal(c.routing, full[n - 1:n - 1 + m])
        np.testing.assert_array_equal(c.prompt_routing, full[:n])
    # Replaying the recorded routing, the trainer's log-probs equal the behavior ones.
    routing = np.zeros((len(out), GRID, L, K), np.int32)
    for b, c in enumerate(out):
        n, m = len(c.prompt_ids), len(c.completion_ids)
        routing[b, :n] = c.prompt_routing
        routing[b, n - 1:n - 1 + m] = c.routing
    for c, ref in zip(out, _trainer_logprobs(model, out, 0.9, jnp.asarray(routing))):
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4)


def test_lengths_inside_buckets_do_not_recompile(model):
    # Bucket sizes no other test uses, so the first call must compile (the counter works).
    sampler = InProcessSampler(model, prompt_buckets=(12, 24), completion_buckets=(10, 20), max_batch=8,
                               batch_buckets=(8,), attention_block=32)
    before = sampler.compiled_programs()
    sampler.generate([[1, 2, 3], [4] * 9], SamplingParams(max_new_tokens=7, n=2, seed=0))
    after_first = sampler.compiled_programs()
    # An empty slot state, one insert (prefill + first token), one decode chunk; capacity 32 (one attention block) throughout.
    assert after_first == before + 3
    # Other prompt lengths, max_new_tokens, row counts, settings and seeds inside the same shapes.
    sampler.generate([[5] * 12, [6], [7, 8]], SamplingParams(max_new_tokens=4, temperature=0.5, top_k=3, seed=9))
    sampler.generate([[5] * 11], SamplingParams(max_new_tokens=3, n=4, top_p=0.5, stop_token_ids=(1, 2, 3)))
    assert sampler.compiled_programs() == after_first
    sampler.generate([[5] * 13], SamplingParams(max_new_tokens=3))  # next prompt bucket: one more insert
    assert sampler.compiled_programs() == after_first + 1


def test_update_weights_swaps_in_place_without_recompiling(model, sampler):
    params = SamplingParams(max_new_tokens=8, seed=3)
    before = sampler.generate(PROMPTS, params)
    programs = sampler.compiled_programs()
    state = nnx.state(sharp_model(seed=1), nnx.Param)
    old_version = sampler.version
    try:
        sampler.update_weights(state, version=5)
        # The sampler copied the arrays: a trainer that donates (deletes) its buffers is safe.
        for leaf in jax.tree.leaves(state):
            leaf.delete()
        after = sampler.generate(PROMPTS, params)
        assert sampler.compiled_programs() == programs
        assert all(c.version == 5 for c in after) and sampler.version == 5
        assert [c.completion_ids for c in after] != [c.completion_ids for c in before]
        fresh = InProcessSampler(sharp_model(seed=1), **BUCKETS)
        assert [c.completion_ids for c in after] == [c.completion_ids for c in fresh.generate(PROMPTS, params)]
        wrong = nnx.state(Decoder(get_preset("tiny", mlp_dim=96), rngs=nnx.Rngs(0)), nnx.Param)
        with pytest.raises(ValueError, match=r"new weight 'layers/mlp/down' is float32\[2, 96, 64\]"):
            sampler.update_weights(wrong, version=6)
        assert sampler.version == 5
    finally:
        sampler.update_weights(nnx.state(model, nnx.Param), version=old_version)
