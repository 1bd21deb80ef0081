"""
nanoGPT's configuration contract, without exec-ing into a script's globals:

    python train.py config/override_file.py --batch_size=32

A config file is python of plain assignments to known keys; then each `--key=value` is parsed with
`literal_eval` (a bare word is a string) and must have the default's type. `configure` returns the new
settings and touches nothing else, so a bad setting fails before any side effect.
"""

import difflib
import os
from ast import literal_eval


class ConfigError(ValueError):
    pass


def _checked(key, value, defaults, source):
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown config key '{key}' in {source}{hint}")
    default = defaults[key]
    if default is None or value is None:
        return value
    if type(default) is float and type(value) is int:  # --learning_rate=1 means 1.0
        return float(value)
    if type(value) is not type(default):
        raise ConfigError(f"{key} must be {type(default).__name__} (default {default!r}), "
                          f"got {type(value).__name__} {value!r} in {source}")
    return value


def configure(defaults: dict, argv: list[str]) -> dict:
    """defaults + config files + --key=value overrides, in argv order -> a new dict."""
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg}")
            namespace = {}
            with open(arg) as f:
                code = compile(f.read(), arg, "exec")
            exec(code, namespace)
            for key, value in namespace.items():
                # private helpers (_x), imports and functions are not settings
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                config[key] = _checked(key, value, defaults, arg)
        else:
            key, sep, raw = arg[2:].partition("=")
            if not sep:
                raise ConfigError(f"expected --key=value, got '{arg}'")
            try:
                value = literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare string: --dataset=shakespeare_char
            config[key] = _checked(key, value, defaults, arg)
    return config
