"""`rljax <command>`: the command line.

Commands parse their own flags; configs use ml_collections' config_flags so
`--config configs/dapo.py --config.loss.eps_high=0.3` works everywhere, and
every resolved config is validated before it is used.
"""

import sys

USAGE = """usage: rljax <command> [flags]

commands:
  recipes                  print every recipe's five axes (from the registry)
  config --config PATH     print the resolved, validated config
  train [--config PATH] [--workdir DIR] [--config.FIELD=VALUE ...]
                           train (resumes when DIR holds a run)
  eval [--config PATH] --workdir RUN   held-out accuracy of RUN's latest checkpoint
  plot RUN_DIR [--out PNG] reward, length, KL, clip and mismatch curves
  serve [--config PATH] [--config.FIELD=VALUE ...]   serve the sampler over HTTP
  sweep SWEEP.py [--print] [--workdir DIR] [--steps N]   run a sweep, write results
"""


def _config_path(argv: list[str], default: str | None) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return default


def _check_override_keys(argv: list[str], path: str) -> None:
    """Names an unknown `--config.KEY` before config_flags reports it badly.

    config_flags raises a bare AttributeError("'foo'") for an unknown field;
    we load the file once more and name the key and the valid ones.
    """
    import runpy

    from rljax import recipes

    keys = [a[len("--config."):].split("=", 1)[0] for a in argv
            if a.startswith("--config.")]
    if not keys:
        return
    file, _, arg = path.partition(":")
    module = runpy.run_path(file)
    config = module["get_config"](arg) if arg else module["get_config"]()
    for key in keys:
        recipes.check_key(config, key)


def load_config(argv: list[str], default=None, validate=None):
    """Parses `--config PATH [--config.FIELD=VALUE ...]`; returns the config.

    `default` is a config file path or a ConfigDict used when no `--config`
    is given. Other flags are returned untouched as the second value.
    `validate(config)` replaces the train/recipe validation (e.g. `serve`).
    """
    from absl import flags
    from ml_collections import config_flags

    from rljax import recipes

    path = _config_path(argv, None if not isinstance(default, str) else default)
    fv = flags.FlagValues()
    if path is None:
        if default is None:
            raise ValueError("--config PATH is required")
        for arg in argv:
            if arg.startswith("--config."):
                recipes.check_key(default, arg[len("--config."):].split("=", 1)[0])
        config_flags.DEFINE_config_dict("config", default, "config", flag_values=fv,
                                        lock_config=True, sys_argv=argv)
    else:
        _check_override_keys(argv, path)
        # sys_argv: config_flags registers the override flags from the argv it
        # is told about (sys.argv by default), not from the one being parsed.
        config_flags.DEFINE_config_file("config", path, "config file",
                                        flag_values=fv, lock_config=True,
                                        sys_argv=argv)
    rest = fv(argv, known_only=True)
    config = fv.config
    if validate is not None:
        validate(config)
    elif "optim" in config:
        from rljax.train import config as config_lib
        config_lib.validate(config)
    else:
        recipes.validate(config)
    return config, rest


def _cmd_recipes(argv):
    from rljax import recipes
    print(recipes.table())


def _default_config():
    from rljax.train import config as config_lib
    return config_lib.get_config("grpo")


def _cmd_config(argv):
    config, _ = load_config(argv, default=_default_config())
    print(config)


def _flag(rest: list[str], name: str, default=None):
    """Removes `--name VALUE` / `--name=VALUE` from `rest`; returns VALUE."""
    value = default
    out = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == f"--{name}" and i + 1 < len(rest):
            value = rest[i + 1]
            i += 2
            continue
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
            i += 1
            continue
        out.append(arg)
        i += 1
    rest[:] = out
    return value


def _quiet_logs():
    import logging
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file at INFO
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _cmd_train(argv):
    import json
    import time
    from rljax.train import loop
    config, rest = load_config(argv, default=_default_config())
    workdir = _flag(rest, "workdir") or f"runs/{config.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    _quiet_logs()
    summary = loop.train(config, workdir)
    print(json.dumps(summary, indent=2))
    print(f"run directory: {workdir}")


def _cmd_eval(argv):
    import json
    from rljax.train import loop
    config, rest = load_config(argv, default=_default_config())
    workdir = _flag(rest, "workdir")
    if not workdir:
        raise ValueError("rljax eval needs --workdir RUN (a run directory)")
    _quiet_logs()
    print(json.dumps(loop.evaluate_run(config, workdir), indent=2))


def _cmd_serve(argv):
    from rljax.sampling import server
    config, rest = load_config(argv, default=server.default_config(), validate=server.validate_config)
    if rest[1:]:
        raise ValueError(f"unknown flags {rest[1:]}; settings are --config.FIELD=VALUE")
    server.serve(config)


def _cmd_plot(argv):
    from rljax.train import plot
    if len(argv) < 2:
        raise ValueError("usage: rljax plot RUN_DIR [--out PNG]")
    rest = argv[2:]
    out = _flag(rest, "out")
    print(plot.plot_run(argv[1], out))


# Commands that live elsewhere are named "module:function" and imported only
# when run, so `rljax recipes` never pays for the model or the server.
COMMANDS = {
    "recipes": _cmd_recipes,
    "config": _cmd_config,
    "train": _cmd_train,
    "eval": _cmd_eval,
    "plot": _cmd_plot,
    "serve": _cmd_serve,
    "sweep": "rljax.sweep:cli_main",
}


def _resolve(entry):
    if callable(entry):
        return entry
    import importlib
    module, _, fn = entry.partition(":")
    return getattr(importlib.import_module(module), fn)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd = argv[1]
    if cmd not in COMMANDS:
        print(f"unknown command {cmd!r}; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    try:
        _resolve(COMMANDS[cmd])([argv[0]] + argv[2:])
    except ValueError as e:
        print(f"rljax {cmd}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
