"""Sharded training and sampling on 8 fake CPU devices, and two processes over gloo.

The multi-device bodies run in subprocesses (tests/parallel/_worker.py):
XLA_FLAGS must be set before jax starts, and this process has one device.
They all start together when the first test needs one, so the two cores work
in parallel; each test then waits for its own.

Cases: every recipe on data=2 x fsdp=2 x tensor=2; grpo, ppo (critic) and
gspo on data=8 and on data=2 x fsdp=4; grpo on a MoE model with
data=2 x fsdp=2 x expert=2. Two train steps each, against the same two steps
on one device.

Tolerances (float32, `tiny` preset):
- every step metric (loss, grad_norm, clip fractions, KL, ...): relative
  error <= 1e-4 (seen: <= 5e-6);
- updated parameters: max |sharded - single| <= 5% of the largest single-step
  update (seen: <= 1.6%). Adam's first steps move each weight by ~lr * sign(g),
  so a gradient entry near Adam's eps (1e-8) amplifies reduction-order noise;
  a wrong gradient (sign, rows, shards) moves weights by ~100% of the update.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import AbstractMesh

from rljax import parallel, recipes
from rljax.train import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = str(pathlib.Path(__file__).with_name("_worker.py"))
# Cheaper CPU compiles; both sides of every comparison use the same flags.
FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
TIMEOUT = 900

FSDP_TENSOR = "data2_fsdp2_tensor2"
CASES_ALL = [f"{r}@{FSDP_TENSOR}" for r in recipes.names()]
CASES_FEW = [f"{r}@{m}" for m in ("data8", "data2_fsdp4") for r in ("grpo", "ppo", "gspo")]
CASES_MOE = ["grpo@data2_fsdp2_expert2@tiny-moe"]
METRIC_RTOL = 1e-4
PARAM_TOL = 0.05  # of the largest single-step update
TOY_LR = 1e-3     # configs/toy.py: Adam moves a weight by at most ~lr per step


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {FAST}"
    return env


class _Job:
    """A worker subprocess; `result()` waits and returns its JSON (or fails with its stderr)."""

    def __init__(self, args, devices=8, log=None):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, WORKER, *args], env=_env(devices), cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._out = None

    def result(self):
        if self._out is None:
            try:
                out, err = self.proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
            lines = [l for l in out.splitlines() if l.startswith("RESULT:")]
            if self.proc.returncode or not lines:
                tail = "\n".join(l for l in err.splitlines() if "SPMD" not in l)[-4000:]
                pytest.fail(f"worker {self.proc.args[2:]} exited {self.proc.returncode}:\n{tail}")
            self._out = json.loads(lines[-1][len("RESULT:"):])
        return self._out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    port = _free_port()
    base = {"steps": 2, "task.eval_size": 8}
    multi = dict(base, **{"mesh.data": 2, "mesh.fsdp": 4,
                          "distributed.coordinator_address": f"localhost:{port}",
                          "distributed.num_processes": 2})
    started = {
        "steps_all": _Job(["steps", ",".join(CASES_ALL)]),
        "steps_few": _Job(["steps", ",".join(CASES_FEW + CASES_MOE)]),
        "sampler": _Job(["sampler"]),
        "single": _Job(["trainer", str(tmp / "single"), json.dumps(base), str(tmp / "single.npz")],
                       devices=1),
    }
    for pid in (0, 1):
        started[f"process{pid}"] = _Job(
            ["trainer", str(tmp / "multi"), json.dumps(dict(multi, **{"distributed.process_id": pid})),
             str(tmp / "multi.npz")], devices=4)
    started["tmp"] = tmp
    yield started
    for job in started.values():
        if isinstance(job, _Job) and job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


# ----------------------------------------------------------------------------
# In-process: mesh arithmetic, rules, config validation.


def test_mesh_sizes_resolve_minus_one_and_reject_bad_shapes():
    assert parallel.mesh_sizes(dict(data=-1, fsdp=4, tensor=1, expert=1), 8) == dict(
        data=2, fsdp=4, tensor=1, expert=1)
    assert parallel.mesh_sizes(dict(data=2, fsdp=2, tensor=2, expert=1), 8)["tensor"] == 2
    with pytest.raises(ValueError, match="not a multiple"):
        parallel.mesh_sizes(dict(data=-1, fsdp=3, tensor=1, expert=1), 8)
    with pytest.raises(ValueError, match="has 4 devices, but there are 8"):
        parallel.mesh_sizes(dict(data=2, fsdp=2, tensor=1, expert=1), 8)
    with pytest.raises(ValueError, match="at most one may be -1"):
        parallel.mesh_sizes(dict(data=-1, fsdp=-1, tensor=1, expert=1), 8)


def test_logical_to_spec_uses_rules_and_replicates_what_does_not_divide():
    mesh = AbstractMesh((2, 2, 2, 1), parallel.MESH_AXES)

    def spec(*args):
        return tuple(parallel.logical_to_spec(*args))
    assert spec(("vocab", "embed"), (256, 64), mesh) == ("tensor", "fsdp")
    assert spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh) == ("fsdp", "tensor")
    # SmolLM2's 9 heads / 3 kv heads do not split two ways: replicated, not an error.
    assert spec(("embed", "kv_heads", "head_dim"), (576, 3, 64), mesh) == ("fsdp",)
    assert spec(("batch", "length"), (16, 24), mesh) == (("data", "fsdp"),)
    assert spec(("batch",), (6,), mesh) == ("data",)  # 6 rows: fsdp would not divide
    # A mesh axis serves one dimension only.
    rules = parallel.parse_rules({"embed": "fsdp", "mlp": "fsdp,tensor"})
    assert spec(("embed", "mlp"), (64, 128), mesh, rules) == ("fsdp", "tensor")
    # Axes missing from the mesh (the sampler's has no fsdp) are skipped.
    sampler_mesh = AbstractMesh((4, 2), parallel.SAMPLER_AXES)
    assert spec(("vocab", "embed"), (256, 64), sampler_mesh) == ("tensor",)
    with pytest.raises(ValueError, match="no rule"):
        spec(("nonsense",), (4,), mesh)


def test_config_mesh_section_is_validated():
    c = config_lib.get_config("grpo")
    assert c.mesh.data == -1 and c.logical_axis_rules.embed == "fsdp"
    assert dict(parallel.rules_from_config(c)) == dict(parallel.DEFAULT_RULES)
    with pytest.raises(ValueError, match="mesh.fsdp"):
        config_lib.get_config("grpo", **{"mesh.fsdp": 0})
    with pytest.raises(ValueError, match="logical_axis_rules.embed.*unknown mesh axis 'fdsp'"):
        config_lib.get_config("grpo", **{"logical_axis_rules.embed": "fdsp"})
    with pytest.raises(ValueError, match="cannot be split over the batch axes"):
        config_lib.get_config("grpo", **{"mesh.fsdp": 3})
    with pytest.raises(ValueError, match="distributed.initialize"):
        config_lib.get_config("grpo", **{"distributed.initialize": "maybe"})
    with pytest.raises(ValueError, match="unknown config key"):
        config_lib.get_config("grpo", **{"mesh.pipeline": 2})


def test_initialize_is_a_no_op_on_one_host():
    assert not parallel.initialize(config_lib.get_config("grpo"))


# ----------------------------------------------------------------------------
# 8 fake devices: the train step.


def _case(jobs, case):
    return jobs["steps_all" if case in CASES_ALL else "steps_few"].result()[case]


@pytest.mark.parametrize("case", CASES_ALL + CASES_FEW + CASES_MOE)
def test_sharded_train_step_matches_single_device(jobs, case):
    r = _case(jobs, case)
    mesh = case.split("@")[1]
    # The two sides really differ: parameters are split on every mesh but pure data parallelism.
    split = {s for s in r["specs"].values() if s != "P()"}
    assert bool(split) == (mesh != "data8"), r["specs"]
    assert r["skipped"] == 0
    for step in range(2):
        assert min(r["params_moved"]) > 1e-4  # the update is not trivially zero
        np.testing.assert_allclose(r["loss"][step], r["loss_ref"][step], rtol=METRIC_RTOL, atol=1e-7)
        assert r["metrics_rel"][step] <= METRIC_RTOL, (step, r["metrics_rel"])
        assert r["params_err"][step] <= PARAM_TOL, (step, r["params_err"], r["worst"])
    assert r["cache_size"] == 1  # two steps, one compilation


@pytest.mark.parametrize("case", [c for c in CASES_ALL + CASES_FEW + CASES_MOE if "data8" not in c])
def test_large_parameters_and_moments_are_sharded(jobs, case):
    r = _case(jobs, case)
    assert r["large_leaves"] > 0 and r["unsharded_large"] == [], r["unsharded_large"]
    specs = r["specs"]
    if "tensor2" in case:
        assert "tensor" in specs["['layers']['mlp']['up'].value"]
        assert "tensor" in specs["['embed'].value"]  # vocab over tensor
    if "expert2" in case:
        assert specs["['layers']['mlp']['up'].value"].startswith("P(None, 'expert'")  # [layers, experts, ...]


def test_pure_data_parallel_replicates_parameters(jobs):
    r = _case(jobs, "grpo@data8")
    assert len(r["unsharded_large"]) == r["large_leaves"]


# ----------------------------------------------------------------------------
# 8 fake devices: the sampler.


def test_sharded_sampler_generates_the_same_tokens(jobs):
    r = jobs["sampler"].result()
    assert "tensor" in r["specs"]["['layers']['mlp']['up'].value"]
    for tag in ("initial", "synced"):
        for mode in ("greedy", "sampled"):
            assert r[f"{tag}_{mode}_tokens"] > 0
            assert r[f"{tag}_{mode}_same_tokens"], (tag, mode)
            assert r[f"{tag}_{mode}_logp_err"] < 1e-4
    # A sync from FSDP-sharded trainer weights reshards onto the sampler's mesh, no recompile.
    assert r["synced_specs"] == r["specs"]
    assert r["recompiled"] == 0
    assert r["cache_spec"] == "P(None, 'data', None, 'tensor')"  # [layers, batch, length, kv_heads, ...]
    assert r["cache_lengths_spec"] == "P('data',)"


def test_init_through_eval_shape_is_born_sharded(jobs):
    r = jobs["sampler"].result()
    assert r["init_err"] < 1e-6 and r["init_unsharded"] == []


# ----------------------------------------------------------------------------
# Two processes x 4 devices over gloo vs. one process on one device.


def _metrics(path):
    return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines() if l.strip()]


def test_two_processes_agree_with_one(jobs):
    p0, p1, single = jobs["process0"].result(), jobs["process1"].result(), jobs["single"].result()
    tmp = jobs["tmp"]
    assert (p0["processes"], p0["devices"], p1["process"]) == (2, 8, 1)
    assert p0["mesh"] == "data=2 fsdp=4 tensor=1 expert=1 (8 devices, 2 processes)"
    assert p0["sampler_devices"] == 4  # each process samples on its own devices
    assert p0["step_programs"] == 1 and single["devices"] == 1
    multi, ref = _metrics(tmp / "multi" / "metrics.jsonl"), _metrics(tmp / "single" / "metrics.jsonl")
    # Only process 0 wrote: one row per step, as on one process.
    assert [r["step"] for r in multi] == [r["step"] for r in ref]
    rows = [(a, b) for a, b in zip(multi, ref) if "loss" in a]
    assert len(rows) == 2
    for a, b in rows:
        assert a["reward_mean"] == b["reward_mean"]  # the same sampled tokens
        for k in ("grad_norm", "entropy", "kl", "clip_frac"):
            if k in b:
                np.testing.assert_allclose(a[k], b[k], rtol=METRIC_RTOL, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(a["loss"], b["loss"], atol=1e-6)  # on-policy GRPO loss is ~0
    got, want = np.load(tmp / "multi.npz"), np.load(tmp / "single.npz")
    assert sorted(got.files) == sorted(want.files)
    for k in want.files:
        np.testing.assert_allclose(got[k], want[k], atol=PARAM_TOL * TOY_LR, err_msg=k)
    # The checkpoint was written by both processes into one orbax step.
    state = tmp / "multi" / "checkpoints" / "2" / "state"
    assert (state / "ocdbt.process_0").exists() and (state / "ocdbt.process_1").exists()
