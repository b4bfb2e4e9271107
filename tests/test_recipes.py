"""Recipes as configs: registry, defaults (docs/algorithms.md §8), validation, CLI loading."""

import pathlib
import re
import subprocess
import sys

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

import rljax
from rljax import cli
from rljax import recipes
from rljax.train import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_names_cover_spec_table():
    assert recipes.names() == ["ppo", "rloo", "grpo", "dr_grpo", "dapo", "gspo",
                               "cispo", "gmpo", "sapo", "max_rl"]
    for name in recipes.names():
        r = recipes.describe(name)
        assert r.description and r.paper


@pytest.mark.parametrize("name,field,want", [
    ("grpo", "loss.norm", "seq_mean_token_mean"),
    ("grpo", "kl.beta", 0.04),
    ("grpo", "kl.estimator", "k3"),
    ("ppo", "advantage.estimator", "gae"),
    ("ppo", "kl.placement", "reward"),
    ("ppo", "kl.beta", 0.05),
    ("rloo", "advantage.baseline", "leave_one_out"),
    ("rloo", "loss.norm", "seq_mean_token_sum"),
    ("dr_grpo", "advantage.scale", "none"),
    ("dr_grpo", "loss.norm", "token_sum_norm"),
    ("dr_grpo", "kl.placement", "none"),
    ("dapo", "loss.eps_high", 0.28),
    ("dapo", "dapo.dynamic_sampling", True),
    ("gspo", "loss.eps_low", 3e-4),
    ("gspo", "loss.eps_high", 4e-4),
    ("cispo", "loss.norm", "group_token_mean"),
    ("cispo", "loss.cispo_max", 5.0),
    ("gmpo", "loss.gmpo_delta", 0.4),
    ("sapo", "loss.sapo_tau_neg", 1.05),
    ("max_rl", "advantage.scale", "group_mean"),
    ("max_rl", "kl.beta", 0.04),  # from its base, grpo
])
def test_spec_defaults(name, field, want):
    c = recipes.get(name)
    section, key = field.split(".")
    assert c[section][key] == want


def test_max_rl_on_another_base_changes_only_the_scale():
    base, swapped = recipes.get("dapo"), recipes.get("max_rl", base="dapo")
    assert swapped.advantage.scale == "group_mean" != base.advantage.scale
    d1, d2 = base.to_dict(), swapped.to_dict()
    d1.pop("recipe"), d2.pop("recipe")
    d1["advantage"].pop("scale"), d2["advantage"].pop("scale")
    assert d1 == d2


def test_overrides_nested_and_dotted():
    c = recipes.get("dapo", loss={"eps_high": 0.3}, **{"kl.beta": 0.0})
    assert c.loss.eps_high == 0.3
    assert c.loss.eps_low == 0.2


@pytest.mark.parametrize("overrides,match", [
    ({"loss.eps_hi": 0.3}, r"unknown config key 'loss.eps_hi'.*eps_high"),
    ({"lss.eps_high": 0.3}, r"no section 'lss'.*loss"),
    ({"loss.type": "ppo"}, r"loss.type='ppo'.*'clip'"),
    ({"group_size": 1, "advantage.baseline": "leave_one_out"},
     r"leave_one_out.*group_size >= 2"),
    ({"loss.eps_low": 1.0}, r"loss.eps_low=1.0 must be in \[0, 1\)"),
    ({"loss.norm": "token_mean", "loss.type": "sequence_clip"},
     r"sequence-level trust region.*seq_mean"),
    ({"loss.norm": "seq_mean"}, r"one term per row.*loss.type"),
    ({"kl.beta": -0.1}, r"kl.beta=-0.1 must be >= 0"),
    ({"offpolicy.level": "token"}, r"recompute_old_logp"),
    ({"loss.eps_high": "wide"}, r"loss.eps_high"),
    ({"advantage.scale": "std"}, r"advantage.scale='std'.*group_std"),
])
def test_validation_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        recipes.get("grpo", **overrides)


def test_unknown_recipe_lists_choices():
    with pytest.raises(ValueError, match="unknown recipe 'ppo2'.*grpo.*max_rl"):
        recipes.get("ppo2")


def test_rloo_rejects_several_steps_without_trust_region():
    with pytest.raises(ValueError, match="no trust region"):
        recipes.get("rloo", **{"offpolicy.epochs": 2})


def test_configs_are_locked():
    c = recipes.get("grpo")
    with pytest.raises(AttributeError):
        c.loss.eps_hgh = 0.3


def test_configs_hold_no_per_recipe_wrappers():
    # One way to pick a recipe: configs/base.py:<recipe>. Every other config
    # file carries a real difference (a task, a model, an environment).
    names = sorted(p.stem for p in (ROOT / "configs").glob("*.py"))
    assert names == ["agent_calculator", "base", "toy", "toy_multiturn"]
    assert not set(names) & set(recipes.names())


@pytest.mark.parametrize("name", recipes.names())
def test_base_config_picks_each_recipe_with_config_flags(name):
    argv = ["prog", f"--config={ROOT / 'configs' / 'base.py'}:{name}",
            "--config.loss.eps_high=0.3"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv,
                                    lock_config=True, sys_argv=argv)
    fv(argv)
    assert isinstance(fv.config, ml_collections.ConfigDict)
    assert fv.config.recipe == name
    assert fv.config.loss.eps_high == 0.3
    ref = config_lib.get_config(name).to_dict()
    got = fv.config.to_dict()
    assert got.pop("loss")["eps_high"] == 0.3
    ref.pop("loss")
    assert got == ref


def test_cli_parse_validates_after_overrides():
    path = f"{ROOT / 'configs' / 'base.py'}:gspo"
    args = cli.parse("train", [f"--config={path}", "--config.loss.eps_high=0.001",
                               "--workdir", "/tmp/x"])
    assert args.config.loss.eps_high == 0.001 and args.config.recipe == "gspo"
    assert args.workdir == "/tmp/x" and args.positional == []
    with pytest.raises(ValueError, match="sequence-level.*seq_mean"):
        cli.parse("config", [f"--config={path}", "--config.loss.norm=token_mean"])
    with pytest.raises(ValueError, match="unknown config key 'loss.foo'.*eps_high"):
        cli.parse("config", [f"--config={path}", "--config.loss.foo=1"])
    # Without --config: the main job's grpo, overrides checked the same way.
    assert cli.parse("config", ["--config.steps=3"]).config.steps == 3
    with pytest.raises(ValueError, match="unknown config key 'stepz'"):
        cli.parse("train", ["--config.stepz=3"])


@pytest.mark.parametrize("argv,match", [
    (["config", "--workdir=x"], "Unknown command line flag 'workdir'"),
    (["train", "--config", "configs/nope.py"], "no such file 'configs/nope.py'"),
    (["sweep", "a.py", "--steps=two"], "steps"),
    (["sweep"], "takes SWEEP.py"),
    (["plot", "--out", "x.png"], "takes RUN_DIR"),
    (["recipes", "--config.steps=3"], "takes no --config"),
    (["eval", "--workdir", "/nonexistent"], "holds no run"),
])
def test_cli_errors_are_one_line_naming_the_flag(argv, match, capsys):
    assert cli.main(["rljax"] + argv) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1, err


def test_recipes_command_prints_the_registry(capsys):
    assert cli.main(["rljax", "recipes"]) == 0
    out = capsys.readouterr().out
    for name in recipes.names():
        assert f"| {name} |" in out
    assert "| dapo | group_mean / group_std | token_mean | clip 0.2/0.28 |" in out
    assert cli.main(["rljax", "nope"]) == 2


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "rljax.cli", "config",
                          f"--config={ROOT / 'configs' / 'base.py'}:dapo",
                          "--config.loss.eps_high=0.3"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert "eps_high: 0.3" in out.stdout


def test_public_api():
    for name in ["compute_advantages", "token_weights", "rollout_token_weights", "policy_loss",
                 "token_streams", "train_batch", "recipes", "Rollout", "TrainBatch"]:
        assert name in rljax.__all__ and hasattr(rljax, name)


def test_load_run_config_replaces_free_form_sections(tmp_path):
    """A saved toy run reloads with its own task args, not the main job's."""
    import runpy
    toy = runpy.run_path(str(ROOT / "configs" / "toy.py"))["get_config"]()
    (tmp_path / "config.json").write_text(toy.to_json_best_effort())
    loaded = config_lib.load_run_config(tmp_path)
    assert config_lib.get_config().task.args.to_dict() != toy.task.args.to_dict()
    assert loaded.task.args.to_dict() == toy.task.args.to_dict()
    assert loaded.to_dict() == toy.to_dict()
