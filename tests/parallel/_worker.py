"""Multi-device bodies of tests/parallel, run in a subprocess with fake CPU devices.

`python tests/parallel/_worker.py SCENARIO [ARGS]` prints one JSON line
(prefixed RESULT:) with everything the pytest side asserts on. XLA_FLAGS
must be set by the caller before this process imports jax.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

jax.config.update("jax_numpy_rank_promotion", "raise")

from rljax import objective, parallel  # noqa: E402
from rljax.batch import Rollout, TrainBatch  # noqa: E402
from rljax.models import ValueModel, get_preset  # noqa: E402
from rljax.models import transformer  # noqa: E402
from rljax.train import config as config_lib  # noqa: E402
from rljax.train import step as step_lib  # noqa: E402

MESHES = {
    "data8": dict(data=8, fsdp=1, tensor=1, expert=1),
    "data2_fsdp4": dict(data=2, fsdp=4, tensor=1, expert=1),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2, expert=1),
    "data2_fsdp2_expert2": dict(data=2, fsdp=2, tensor=1, expert=2),
}
ROWS, T, GROUP, MICRO = 16, 24, 4, 2


def run_config(recipe: str, preset: str = "tiny"):
    c = config_lib.get_config(recipe, **{
        "group_size": GROUP, "max_tokens": 16, "optim.lr": 1e-3, "model.source": preset,
        "rollout.prompts_per_step": ROWS // GROUP, "train.micro_batches": MICRO,
        "dapo.overlong_buffer": 4})
    return c


def build(config):
    """(graphdef, params, critic_graphdef, critic_params, optimizer, critic_optimizer) on one device."""
    model = transformer.Decoder(get_preset(config.model.source), rngs=nnx.Rngs(config.seed))
    graphdef, params = nnx.split(model)
    cg = cp = copt = None
    if config.advantage.estimator == "gae":
        cg, cp = nnx.split(ValueModel.from_policy(model))
        # A critic head at zero has zero trunk gradients: give it a direction.
        cp["head"][...] = jax.random.normal(jax.random.key(7), cp["head"][...].shape) * 0.1
        copt = step_lib.make_optimizer(config.optim, config.steps)
    return graphdef, params, cg, cp, step_lib.make_optimizer(config.optim, config.steps), copt


_LOGPROB_FNS: dict = {}


def make_batch(config, graphdef, params, seed: int) -> TrainBatch:
    """An optimizer-step batch the way Trainer.train_on builds one, with log-probs near the model's."""
    rng = np.random.default_rng(seed)
    V = get_preset(config.model.source).vocab_size
    tokens = rng.integers(0, V, (ROWS, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (ROWS, T)).copy()
    prompt = 6
    ends = prompt + rng.integers(2, T - prompt + 1, ROWS)
    mask = ((np.arange(T)[None] >= prompt) & (np.arange(T)[None] < ends[:, None])).astype(np.float32)
    if graphdef not in _LOGPROB_FNS:  # one compilation per model, not per recipe
        _LOGPROB_FNS[graphdef] = step_lib.make_logprob_fn(graphdef, temperature=1.0)
    logp, _ = _LOGPROB_FNS[graphdef](params, jnp.asarray(tokens), jnp.asarray(positions))
    logp = np.asarray(logp)
    behavior = (logp + rng.normal(0, 0.1, logp.shape)).astype(np.float32) * mask
    ref = (logp + rng.normal(0, 0.1, logp.shape)).astype(np.float32) * mask
    rewards = rng.integers(0, 2, ROWS).astype(np.float32)
    values = rng.normal(0, 0.5, (ROWS, T)).astype(np.float32) if config.advantage.estimator == "gae" else None
    # The trainer's own composition: rollout -> streams -> one optimizer step's batch.
    obj = objective.Objective.from_config(config)
    rollout = Rollout.from_arrays(rewards, mask, behavior_logp_BxT=behavior, tokens_BxT=tokens,
                                  positions_BxT=positions)
    streams = objective.token_streams(obj, rollout, objective.Logprobs(
        old_logp_BxT=behavior if obj.recompute_old_logp else None,
        ref_logp_BxT=ref if obj.needs_ref_logp else None, values_BxT=values))
    batch = objective.train_batch(obj, streams, np.arange(ROWS))
    return jax.tree.map(np.asarray, batch)


def _flat(state) -> dict[str, np.ndarray]:
    """The float parameters (policy and critic) of a TrainState, as host arrays by path."""
    trees = {"params": state.params, "critic": state.critic_params}
    return {name + jax.tree_util.keystr(p): np.asarray(parallel.to_host(x), np.float64)
            for name, tree in trees.items() for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _param_error(new: dict, ref: dict, start: dict) -> tuple[float, float, str]:
    """(max |new - ref| / max |ref - start|, max |ref - start|, worst leaf): error relative to the update."""
    moved = max(float(np.max(np.abs(ref[k] - start[k]))) for k in ref)
    errs = {k: float(np.max(np.abs(new[k] - ref[k]))) for k in ref}
    worst = max(errs, key=errs.get)
    return errs[worst] / moved, moved, worst


def _init(params, optimizer, seed, critic_params, critic_optimizer):
    del seed  # the state holds no RNG
    return step_lib.init_state(params, optimizer, critic_params, critic_optimizer)


def steps(cases: list[str]) -> dict:
    """For each "recipe@mesh[@preset]": two train steps sharded vs. on one device."""
    results = {}
    refs = {}
    for case in cases:
        recipe, mesh_name, *rest = case.split("@")
        preset = rest[0] if rest else "tiny"
        t0 = time.perf_counter()
        config = run_config(recipe, preset)
        graphdef, params, cg, cp, opt, copt = build(config)
        batches = [make_batch(config, graphdef, params, seed) for seed in (1, 2)]
        if (recipe, preset) not in refs:
            step = step_lib.make_train_step(config, graphdef, opt, micro_batches=MICRO,
                                            critic_graphdef=cg, critic_optimizer=copt)
            # Copies: the step donates its state, and the sharded run starts from the same values.
            state = _init(jax.tree.map(jnp.copy, params), opt, config.seed,
                          None if cp is None else jax.tree.map(jnp.copy, cp), copt)
            out = []
            for b in batches:
                state, m = step(state, jax.tree.map(jnp.asarray, b))
                out.append((jax.device_get(m), _flat(state)))
            refs[recipe, preset] = out
        ref = refs[recipe, preset]

        mesh = parallel.make_mesh(MESHES[mesh_name])
        rules = parallel.rules_from_config(config)
        sh_params = parallel.shard_params(params, mesh, rules)
        sh_cp = None if cp is None else parallel.shard_params(cp, mesh, rules)
        init_fn = lambda p, c: _init(p, opt, config.seed, c, copt)  # noqa: E731
        state, state_sh = parallel.init_state_sharded(init_fn, mesh, rules, sh_params, sh_cp)
        bsh = parallel.batch_sharding(mesh, rules)
        step = step_lib.make_train_step(config, graphdef, opt, micro_batches=MICRO,
                                        critic_graphdef=cg, critic_optimizer=copt,
                                        state_sharding=state_sh, batch_sharding=bsh)
        row = {"loss": [], "loss_ref": [], "metrics_rel": [], "params_err": [], "params_moved": [],
               "worst": []}
        start = _flat(state)
        for i, b in enumerate(batches):
            state, m = step(state, parallel.shard_batch(b, bsh))
            m = jax.device_get(m)
            m_ref, p_ref = ref[i]
            row["loss"].append(float(m["loss"]))
            row["loss_ref"].append(float(m_ref["loss"]))
            row["skipped"] = int(m["skipped"]) + int(m_ref["skipped"])
            row["metrics_rel"].append(max(abs(float(m[k]) - float(m_ref[k])) / (abs(float(m_ref[k])) + 1e-6)
                                          for k in m_ref))
            err, moved, worst = _param_error(_flat(state), p_ref, start)
            row["params_err"].append(err)
            row["params_moved"].append(moved)
            row["worst"].append(worst)
            start = p_ref
        row["cache_size"] = step._cache_size()
        # Sharding of every parameter and optimizer moment with >= 2 dims.
        unsharded = []
        for path, x in jax.tree_util.tree_leaves_with_path(state):
            if x.ndim >= 2 and not parallel.is_sharded(x.sharding):
                unsharded.append(jax.tree_util.keystr(path))
        row["large_leaves"] = sum(1 for x in jax.tree.leaves(state) if x.ndim >= 2)
        row["unsharded_large"] = unsharded
        row["specs"] = {jax.tree_util.keystr(p): str(x.sharding.spec)
                        for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
        row["seconds"] = time.perf_counter() - t0
        results[case] = row
    return results


def sampler() -> dict:
    """Greedy and sampled tokens, unsharded vs. on a (data=4, tensor=2) sampler mesh, before and
    after a weight sync from an FSDP x tensor trainer mesh."""
    from rljax.sampling import InProcessSampler, SamplingParams
    from rljax.sampling import sampler as sampler_lib
    cfg = get_preset("tiny")
    model = transformer.Decoder(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 9, 3, 12)]
    kw = dict(prompt_buckets=(16,), completion_buckets=(16,), max_batch=8, batch_buckets=(8,))
    plain = InProcessSampler(model, **kw)
    mesh = parallel.make_sampler_mesh(tensor=2)
    sharded = InProcessSampler(model, mesh=mesh, **kw)
    settings = {"greedy": SamplingParams(max_new_tokens=12, temperature=0.0, n=2, seed=1),
                "sampled": SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, n=2, seed=5)}
    out = {"specs": {jax.tree_util.keystr(p): str(x.sharding.spec)
                     for p, x in jax.tree_util.tree_leaves_with_path(sharded.params)}}

    def compare(tag):
        for name, sp in settings.items():
            a, b = plain.generate(prompts, sp), sharded.generate(prompts, sp)
            out[f"{tag}_{name}_same_tokens"] = all(x.completion_ids == y.completion_ids for x, y in zip(a, b))
            out[f"{tag}_{name}_logp_err"] = max(float(np.max(np.abs(np.subtract(x.logprobs, y.logprobs))))
                                                for x, y in zip(a, b))
            out[f"{tag}_{name}_tokens"] = sum(len(x.completion_ids) for x in a)

    compare("initial")
    programs = sharded.compiled_programs()
    # A sync from the trainer: new weights, sharded FSDP x tensor on the trainer's mesh.
    params = nnx.state(model, nnx.Param)
    moved = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), params)
    trainer_mesh = parallel.make_mesh(MESHES["data2_fsdp2_tensor2"])
    plain.update_weights(moved, 1)
    sharded.update_weights(parallel.shard_params(moved, trainer_mesh), 1)
    compare("synced")
    out["recompiled"] = sharded.compiled_programs() - programs
    out["synced_specs"] = {jax.tree_util.keystr(p): str(x.sharding.spec)
                           for p, x in jax.tree_util.tree_leaves_with_path(sharded.params)}
    # The slot state (KV cache and per-slot arrays) of a sharded engine after it ran rows.
    eng = sharded.engine(capacity=64, slots=8)
    eng.submit([sampler_lib.Row((1, 2, 3), 4, row_id=i) for i in range(8)])
    eng.step()
    out["cache_spec"] = str(eng.state.k.sharding.spec)
    out["cache_lengths_spec"] = str(eng.state.length_B.sharding.spec)
    eng.run()
    # eval_shape -> shardings -> jit(init): the same values as an eager init, born sharded.
    make = lambda: transformer.Decoder(cfg, rngs=nnx.Rngs(3))  # noqa: E731
    _, born = parallel.init_sharded(make, trainer_mesh)
    out["init_err"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                          for a, b in zip(jax.tree.leaves(born), jax.tree.leaves(params)))
    out["init_unsharded"] = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(born)
                             if x.ndim >= 2 and x.sharding.is_fully_replicated]
    return out


def trainer(workdir: str, overrides: str, out_path: str) -> dict:
    """configs/toy.py through Trainer.run() (with overrides); process 0 saves the final params."""
    import pathlib
    import runpy

    from rljax import recipes
    from rljax.train import loop
    root = pathlib.Path(__file__).resolve().parents[2]
    c = runpy.run_path(str(root / "configs" / "toy.py"))["get_config"]()
    recipes.apply_overrides(c, **json.loads(overrides))
    config_lib.validate(c)
    t = loop.Trainer.create(c, workdir)
    summary = t.train()
    params = _flat(t.state)  # a collective on several processes: every process gathers
    if jax.process_index() == 0:
        np.savez(out_path, **params)
    return {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "mesh": parallel.describe(t.run.programs.mesh),
            "sampler_devices": int(next(iter(jax.tree.leaves(t.run.sampler.params))).sharding.num_devices),
            "step_programs": t.run.programs.train_step._cache_size(), "summary": summary}


def main(argv):
    scenario = argv[1]
    if scenario == "steps":
        out = steps(argv[2].split(","))
    elif scenario == "sampler":
        out = sampler()
    elif scenario == "trainer":
        out = trainer(argv[2], argv[3], argv[4])
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print("RESULT:" + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
