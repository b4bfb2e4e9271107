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
  serve [--config PATH] [--port N]   serve the sampler over HTTP
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


def load_config(argv: list[str], default: str | None = None):
    """Parses `--config PATH [--config.FIELD=VALUE ...]`; returns the config.

    Other flags are returned untouched as the second value, for the command.
    """
    from absl import flags
    from ml_collections import config_flags

    from rljax import recipes

    path = _config_path(argv, default)
    if path is None:
        raise ValueError("--config PATH is required")
    _check_override_keys(argv, path)
    fv = flags.FlagValues()
    # sys_argv: config_flags registers the override flags from the argv it
    # is told about (sys.argv by default), not from the one being parsed.
    config_flags.DEFINE_config_file("config", default, "config file",
                                    flag_values=fv, lock_config=True,
                                    sys_argv=argv)
    rest = fv(argv, known_only=True)
    config = fv.config
    recipes.validate(config)
    return config, rest


def _cmd_recipes(argv):
    from rljax import recipes
    print(recipes.table())


def _cmd_config(argv):
    import pathlib
    base = str(pathlib.Path.cwd() / "configs" / "base.py")
    config, _ = load_config(argv, default=base)
    print(config)


# Commands that live elsewhere are named "module:function" and imported only
# when run, so `rljax recipes` never pays for the model or the server.
COMMANDS = {
    "recipes": _cmd_recipes,
    "config": _cmd_config,
    "serve": "rljax.sampling.server:cli_main",
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
