"""`rljax sweep`: expansion, validation before any run, --print, results files."""

import csv
import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from rljax import sweep as sweep_lib
from rljax.train import loop

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOY = "configs/toy.py"


def test_product_expands_in_order_with_fixed_and_per_point_base():
    points = sweep_lib.expand({
        "name": "s", "base": f"{TOY}:grpo", "fixed": {"steps": 7},
        "product": {"base": [f"{TOY}:grpo", f"{TOY}:dapo"], "seed": [0, 1]}})
    assert [p.label for p in points] == [
        "grpo seed=0", "grpo seed=1", "dapo seed=0", "dapo seed=1"]
    assert [p.base for p in points] == [f"{TOY}:grpo"] * 2 + [f"{TOY}:dapo"] * 2
    assert points[3].overrides == {"steps": 7, "seed": 1}
    assert points[3].dirname == "03_dapo_seed=1"


def test_list_form_keeps_the_sweep_base_out_of_labels():
    points = sweep_lib.expand({"name": "s", "base": f"{TOY}:dapo",
                               "overrides": [{"loss.eps_high": 0.2}, {}]})
    assert [p.label for p in points] == ["loss.eps_high=0.2", "base"]
    assert [p.dirname for p in points] == ["00_loss.eps_high=0.2", "01_base"]


@pytest.mark.parametrize("sweep, match", [
    ({"overrides": [{}]}, "needs 'base'"),
    ({"base": TOY}, "exactly one of"),
    ({"base": TOY, "overrides": [{}], "product": {"seed": [0]}}, "exactly one of"),
    ({"base": TOY, "overrides": []}, "non-empty list"),
    ({"base": TOY, "overrides": [0.3]}, "point 0 is float"),
    ({"base": TOY, "product": {"seed": 3}}, "'seed' needs a non-empty list"),
    ({"base": TOY, "overrides": [{}], "seeds": [1]}, "unknown sweep fields"),
    ({"base": TOY, "overrides": [{"seed": 1}, {"seed": 1}]}, "points repeat"),
])
def test_malformed_sweeps_are_rejected(sweep, match):
    with pytest.raises(ValueError, match=match):
        sweep_lib.expand({"name": "s", **sweep})


def _trains(monkeypatch):
    calls = []
    monkeypatch.setattr(loop, "train", lambda config, workdir: calls.append(workdir))
    return calls


def test_an_unknown_key_fails_before_any_point_runs(tmp_path, monkeypatch):
    calls = _trains(monkeypatch)
    sweep = {"name": "s", "base": f"{TOY}:dapo",
             "overrides": [{"loss.eps_high": 0.3}, {"loss.eps_hihg": 0.3}]}
    with pytest.raises(ValueError, match=r"sweep point 1 \(loss.eps_hihg=0.3\).*"
                                         r"unknown config key 'loss.eps_hihg'"):
        sweep_lib.run_sweep(sweep, tmp_path / "sw")
    assert calls == [] and not (tmp_path / "sw").exists()


def test_an_impossible_combination_names_the_point(tmp_path, monkeypatch):
    calls = _trains(monkeypatch)
    sweep = {"name": "s", "base": f"{TOY}:grpo",
             "overrides": [{"seed": 1}, {"loss.norm": "seq_mean"}]}
    with pytest.raises(ValueError, match=r"sweep point 1 .*loss.norm='seq_mean'"):
        sweep_lib.run_sweep(sweep, tmp_path / "sw")
    assert calls == []


def test_a_missing_base_file_is_named():
    with pytest.raises(ValueError, match="base config 'configs/nope.py' not found"):
        sweep_lib.point_config(sweep_lib.expand(
            {"name": "s", "base": "configs/nope.py", "overrides": [{}]})[0])


def _write_sweep(path, body: dict) -> pathlib.Path:
    path.write_text(f"def get_sweep():\n    return {body!r}\n")
    return path


def test_print_emits_one_runnable_command_per_point(tmp_path, capsys, monkeypatch):
    from rljax import cli
    calls = _trains(monkeypatch)
    monkeypatch.chdir(ROOT)
    file = _write_sweep(tmp_path / "eps.py", {
        "base": f"{TOY}:dapo", "product": {"loss.eps_high": [0.2, 0.28], "task.name": ["toy_copy"]}})
    assert cli.main(["rljax", "sweep", str(file), "--print", "--workdir",
                     str(tmp_path / "w"), "--steps", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert calls == [] and not (tmp_path / "w").exists()
    assert len(lines) == 2
    argv = shlex.split(lines[1])
    assert argv[:4] == ["rljax", "train", "--config", f"{TOY}:dapo"]
    assert argv[4:6] == ["--workdir", str(tmp_path / "w" / "01_loss.eps_high=0.28_task.name=toy_copy")]
    # The printed line is what `rljax train` parses: the overrides arrive typed.
    args = cli.parse("train", argv[2:])
    config = args.config
    assert config.loss.eps_high == 0.28 and config.steps == 5
    assert config.task.name == "toy_copy" and config.recipe == "dapo"
    assert args.workdir == argv[5]


def _fake_train(fail_seed):
    """Stands in for loop.train: writes the metrics rows a real run writes."""
    def train(config, workdir):
        if config.seed == fail_seed:
            raise RuntimeError("boom")
        rows = [{"step": 0, "eval_reward": 0.1, "eval_accuracy": 0.0}]
        rows += [{"step": s, "reward_mean": 0.1 * s + config.seed} for s in range(1, 4)]
        rows += [{"step": 3, "eval_reward": 0.5 + config.seed, "eval_accuracy": 0.25}]
        pathlib.Path(workdir, "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
        return {"train_wall_s": 1.5}
    return train


def test_results_rows_and_a_failed_point_does_not_stop_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "train", _fake_train(fail_seed=1))
    sweep = {"name": "s", "base": TOY, "product": {"seed": [0, 1, 2]}}
    rows = sweep_lib.run_sweep(sweep, tmp_path, out=open(os.devnull, "w"))
    assert [r["point"] for r in rows] == ["seed=0", "seed=1", "seed=2"]
    assert [r["eval_reward"] for r in (rows[0], rows[2])] == [0.5, 2.5]
    assert rows[0]["eval_reward_before"] == 0.1 and rows[0]["steps"] == 3
    assert rows[0]["train_wall_s"] == 1.5 and rows[0]["error"] == ""
    assert rows[1]["error"] == "RuntimeError: boom"
    assert "boom" in (tmp_path / "01_seed=1" / "error.txt").read_text()
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["point"] for r in table] == ["seed=0", "seed=1", "seed=2"]
    assert float(table[2]["eval_reward"]) == 2.5
    md = (tmp_path / "results.md").read_text().splitlines()
    assert md[0].startswith("| point | held-out reward |") and len(md) == 5
    assert "| seed=2 | 2.500 | 0.250 | 3 |" in md[4]
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_steps_to_threshold_uses_the_smoothed_curve():
    rows = [{"step": s, "reward_mean": r} for s, r in enumerate([0, 0, 1, 0, 1, 1], 1)]
    rows.insert(0, {"step": 0, "eval_reward": 0.0})  # eval rows are skipped
    assert sweep_lib.steps_to_threshold(rows, 0.5, window=1) == 3
    assert sweep_lib.steps_to_threshold(rows, 0.6, window=3) == 5  # (0+1+1)/3 < 0.6 < 1
    assert sweep_lib.steps_to_threshold(rows, 1.1, window=1) is None


@pytest.fixture(scope="module")
def jax_cache_env(tmp_path_factory):
    # Points differ only in the seed, so with a persistent compilation cache the
    # second point reuses the first's executables: the test times one compile.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def test_two_point_toy_sweep_end_to_end(tmp_path, jax_cache_env):
    file = _write_sweep(tmp_path / "seeds.py", {"base": TOY, "product": {"seed": [0, 1]}})
    work = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "rljax.cli", "sweep", str(file), "--workdir", str(work),
         "--steps", "2"], cwd=ROOT, env=jax_cache_env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(work / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["point"] for r in table] == ["seed=0", "seed=1"]
    for r in table:
        assert r["error"] == "" and r["steps"] == "2"
        assert 0.0 <= float(r["eval_reward"]) <= 1.0 and float(r["wall_s"]) > 0
        run = pathlib.Path(r["run_dir"])
        assert run.parent == work and (run / "checkpoints" / "2").is_dir()
        assert json.loads((run / "config.json").read_text())["steps"] == 2
    seeds = [json.loads((pathlib.Path(r["run_dir"]) / "config.json").read_text())["seed"]
             for r in table]
    assert seeds == [0, 1]
    md = (work / "results.md").read_text()
    assert md.count("\n| seed=") == 2 and md in proc.stdout
    assert (work / "results.png").read_bytes()[:4] == b"\x89PNG"
