"""`rljax <command>`: the command line, one flag parser for every command.

Each command's flags live on one absl `FlagValues`: the config
(`--config PATH[:ARG]`, `--config.FIELD=VALUE`, through ml_collections'
config_flags, which is built on absl) and the plain flags (`--workdir`,
`--steps`, ...). absl because config_flags needs it anyway: one machinery then
parses both, so `--flag=V` and `--flag V`, types, unknown flags and `--help`
behave the same in every command. A recipe is picked with
`--config configs/base.py:<recipe>` (or any config file's `:<recipe>`).
Every resolved run config is validated before it is used.
"""

import dataclasses
import sys
import types
from typing import Any, Callable, Optional

USAGE = """usage: rljax <command> [flags]   (rljax <command> --help for its flags)

commands:
  recipes                                   every recipe's five axes (from the registry)
  config [--config PATH[:RECIPE]]           print the resolved, validated config
  train  [--config PATH[:RECIPE]] [--workdir DIR] [--config.FIELD=VALUE ...]
                                            train (resumes when DIR holds a run)
  eval   --workdir RUN [--config PATH]      held-out accuracy of RUN's latest checkpoint
  plot   RUN_DIR [--out PNG]                reward, length, KL, clip and mismatch curves
  serve  [--config PATH] [--config.FIELD=VALUE ...]   serve the sampler over HTTP
  sweep  SWEEP.py [--print] [--workdir DIR] [--steps N]   run a sweep, write results

Recipes: --config configs/base.py:dapo (or configs/toy.py:dapo, ...); the default
config is configs/base.py's grpo, the main job.
"""


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    kind: str            # string | integer | bool
    default: Any
    help: str
    required: bool = False


@dataclasses.dataclass(frozen=True)
class Command:
    """help, its flags, positional argument names, and how its config defaults.

    config: None (the command takes no config), or plain-flag values -> the
    default ConfigDict used when no `--config` is given.
    """

    help: str
    run: Callable
    flags: tuple = ()
    positional: tuple = ()
    config: Optional[Callable] = None
    validate: bool = True


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _override_keys(argv: list[str]) -> list[str]:
    return [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]


def _load_file(path: str):
    """The ConfigDict a config file[:argument] returns (to name bad override keys)."""
    import pathlib
    import runpy
    file, _, arg = path.partition(":")
    if not pathlib.Path(file).is_file():
        raise ValueError(f"--config {path!r}: no such file {file!r}")
    module = runpy.run_path(file)
    if "get_config" not in module:
        raise ValueError(f"--config {path!r}: {file} defines no get_config()")
    return module["get_config"](arg) if arg else module["get_config"]()


def _define(fv, flag: Flag) -> None:
    from absl import flags
    define = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer,
              "bool": flags.DEFINE_bool}[flag.kind]
    define(flag.name, flag.default, flag.help, flag_values=fv)


def parse(name: str, argv: list[str]) -> types.SimpleNamespace:
    """Parses `rljax <name> ARGV` (argv without the program and command).

    Returns a namespace with `config` (the validated ConfigDict, or None),
    one attribute per plain flag, and `positional` (a list). Bad input raises
    ValueError with one line that names the flag.
    """
    from absl import flags
    from ml_collections import config_flags

    from rljax import recipes
    cmd = COMMANDS[name]
    argv = ["rljax " + name] + list(argv)
    fv = flags.FlagValues()
    for flag in cmd.flags:
        _define(fv, flag)
    keys = _override_keys(argv)
    if cmd.config is not None:
        path = _config_path(argv)
        if path is None:
            plain = flags.FlagValues()
            for flag in cmd.flags:
                _define(plain, flag)
            try:
                plain(argv, known_only=True)
            except flags.Error as e:
                raise ValueError(str(e)) from None
            default = cmd.config({f.name: plain[f.name].value for f in cmd.flags})
            for key in keys:
                recipes.check_key(default, key)
            config_flags.DEFINE_config_dict("config", default, "the config", flag_values=fv,
                                            lock_config=True, sys_argv=argv)
        else:
            # config_flags reports an unknown override key as a bare
            # AttributeError; load the file once more and name the key.
            loaded = _load_file(path)
            for key in keys:
                recipes.check_key(loaded, key)
            # sys_argv: config_flags registers the override flags from the argv
            # it is told about (sys.argv by default), not the one being parsed.
            config_flags.DEFINE_config_file("config", path, "a config file[:argument]",
                                            flag_values=fv, lock_config=True, sys_argv=argv)
    elif keys or _config_path(argv):
        raise ValueError(f"rljax {name} takes no --config")
    try:
        rest = fv(argv)
    except flags.Error as e:
        raise ValueError(str(e)) from None
    positional = rest[1:]
    if len(positional) != len(cmd.positional):
        want = " ".join(cmd.positional) or "no positional arguments"
        raise ValueError(f"rljax {name} takes {want}, got {positional or 'none'}")
    for flag in cmd.flags:
        if flag.required and fv[flag.name].value in (None, ""):
            raise ValueError(f"rljax {name} needs --{flag.name}: {flag.help}")
    out = types.SimpleNamespace(positional=positional, config=None,
                                **{f.name: fv[f.name].value for f in cmd.flags})
    if cmd.config is not None:
        out.config = fv.config
        if cmd.validate:
            _validate(out.config)
    return out


def _validate(config) -> None:
    from rljax import recipes
    if "optim" in config:
        from rljax.train import config as config_lib
        config_lib.validate(config)
    else:
        recipes.validate(config)


def _help(name: str) -> str:
    cmd = COMMANDS[name]
    lines = [f"rljax {' '.join((name,) + cmd.positional)}: {cmd.help}"]
    if cmd.config is not None:
        lines.append("  --config PATH[:ARG]   a config file (get_config(ARG)); "
                     "--config.FIELD=VALUE overrides a field")
    lines += [f"  --{f.name}   {f.help}" for f in cmd.flags]
    return "\n".join(lines)


def _quiet_logs():
    import logging
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file at INFO
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _run_config(_flags):
    from rljax.train import config as config_lib
    return config_lib.get_config("grpo")


def _saved_run_config(values):
    """eval without --config: the run's own config.json."""
    import pathlib
    from rljax.train import config as config_lib
    workdir = values.get("workdir")
    if not workdir or not (pathlib.Path(workdir) / "config.json").is_file():
        raise ValueError(f"--workdir {workdir!r} holds no run (config.json); "
                         "give --workdir RUN or --config PATH")
    return config_lib.load_run_config(workdir)


def _server_config(_flags):
    from rljax.sampling import server
    return server.default_config()


def _cmd_recipes(args):
    from rljax import recipes
    print(recipes.table())


def _cmd_config(args):
    print(args.config)


def _cmd_train(args):
    import json
    import time
    from rljax.train import loop
    workdir = args.workdir or f"runs/{args.config.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    _quiet_logs()
    print(json.dumps(loop.train(args.config, workdir), indent=2))
    print(f"run directory: {workdir}")


def _cmd_eval(args):
    import json
    from rljax.train import loop
    _quiet_logs()
    print(json.dumps(loop.evaluate_run(args.config, args.workdir), indent=2))


def _cmd_plot(args):
    from rljax.train import plot
    print(plot.plot_run(args.positional[0], args.out))


def _cmd_serve(args):
    from rljax.sampling import server
    _quiet_logs()
    server.serve(args.config)


def _cmd_sweep(args):
    from rljax import sweep as sweep_lib
    sweep = sweep_lib.load_sweep(args.positional[0])
    if not args.print:
        _quiet_logs()
    rows = sweep_lib.run_sweep(sweep, args.workdir, print_only=args.print, steps=args.steps)
    if args.print:
        return
    import pathlib
    workdir = pathlib.Path(rows[0]["run_dir"]).parent
    print(sweep_lib.markdown_table(rows, sweep_lib.MD_COLUMNS))
    print(f"results: {workdir / 'results.csv'}, {workdir / 'results.md'}, "
          f"{workdir / 'results.png'}")
    failed = [r["point"] for r in rows if r["error"]]
    if failed:
        raise SystemExit(f"rljax sweep: {len(failed)} point(s) failed: {failed}; see "
                         "error.txt in their run directories")


_WORKDIR = "the run directory"
COMMANDS = {
    "recipes": Command("print every recipe's five axes", _cmd_recipes),
    "config": Command("print the resolved, validated config", _cmd_config, config=_run_config),
    "train": Command("train (resumes when --workdir holds a run)", _cmd_train,
                     flags=(Flag("workdir", "string", None,
                                 _WORKDIR + " (default runs/<recipe>-<time>)"),),
                     config=_run_config),
    "eval": Command("held-out accuracy of a run's latest checkpoint", _cmd_eval,
                    flags=(Flag("workdir", "string", None, _WORKDIR, required=True),),
                    config=_saved_run_config),
    "plot": Command("a run's curves as one PNG", _cmd_plot, positional=("RUN_DIR",),
                    flags=(Flag("out", "string", None, "the PNG (default RUN_DIR/curves.png)"),)),
    "serve": Command("serve the sampler over HTTP", _cmd_serve, config=_server_config,
                     validate=False),
    "sweep": Command("run a sweep, write its results table", _cmd_sweep,
                     positional=("SWEEP.py",),
                     flags=(Flag("print", "bool", False,
                                 "print one `rljax train` command per point instead"),
                            Flag("workdir", "string", None,
                                 "the sweep directory (default runs/sweeps/<name>)"),
                            Flag("steps", "integer", None, "override every point's steps"))),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name = argv[1]
    if name not in COMMANDS:
        print(f"unknown command {name!r}; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in argv[2:]):
        print(_help(name))
        return 0
    try:
        COMMANDS[name].run(parse(name, argv[2:]))
    except ValueError as e:
        print(f"rljax {name}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
