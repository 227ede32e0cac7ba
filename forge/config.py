"""Config: a YAML file plus command-line overrides (OmegaConf), checked against dataclass schemas.

    python -m apps.grpo --config configs/grpo_tiny.yaml trainer.lr=3e-4 +trainer.warmup=10 ~reward.kl

OmegaConf loads the YAML, parses override values and resolves `${a.b}` interpolations. Overrides follow
Hydra's grammar: `key=value` changes a key that exists, `+key=value` adds one, `++key=value` sets it
either way and `~key` deletes it. `validate` then builds the app's dataclass schema from the resolved
config. It walks the schema itself rather than merging into an OmegaConf structured config: that merge
turns `1` or "yes" into a bool, drops the list index from paths inside lists of dataclasses, and
reports a `__post_init__` ValueError with no key at all. Every problem is one `ConfigError` whose
message names the full key path, the bad value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import re
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")

_KEY = re.compile(r"\w[\w-]*(\.\w[\w-]*)*")
_OVERRIDE_HELP = (
    "key=value changes a key, +key=value adds a key, ++key=value sets it either way, ~key deletes it; "
    "values are YAML (3e-4, [1,2], null) and may interpolate, e.g. ${trainer.lr}"
)




class ConfigError(ValueError):
    """A bad config or override; the message is meant for the user and holds every fact needed."""


def parse_args(argv: Sequence[str], *, description: str = "",
               epilog: str = "") -> tuple[Path | None, list[str], argparse.Namespace]:
    """Parses `--config PATH`, `--resume` and the overrides; `-h` prints usage and exits. `epilog` (an app's
    configuration reference) is printed after the options as it is written, line breaks and all."""
    formatter = argparse.RawDescriptionHelpFormatter if epilog else argparse.HelpFormatter
    parser = argparse.ArgumentParser(prog=program_name(), description=description, epilog=epilog or None,
                                     formatter_class=formatter)
    parser.add_argument("--config", type=Path, metavar="PATH", help="YAML config file")
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help=_OVERRIDE_HELP)
    # Intermixed so that `--resume` may come after the overrides too.
    args = parser.parse_intermixed_args(list(argv))
    return args.config, args.overrides, args


def program_name() -> str:
    """How the running program was started, for its usage line: `python -m apps.grpo` for a module run with -m
    (argparse alone would say `__main__.py`), else the script's file name."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return Path(sys.argv[0]).name


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> DictConfig:
    """Loads `path` (or starts empty), applies `overrides` in order and resolves interpolations."""
    cfg = OmegaConf.create() if path is None else _load_yaml(Path(path))
    for override in overrides:
        _apply_override(cfg, override)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise _interpolation_error(e) from None
    return cfg


def validate(cfg: DictConfig | dict, schema: type[T], *, path: str = "") -> T:
    """Builds a `schema` instance from `cfg`, checking every key and value.

    `path` is the dotted key of `cfg` inside the whole config, used in error messages.
    Supported field types: nested dataclasses, `list[X]`, `dict[str, X]`, `X | None`,
    `Literal[...]`, `int`, `float` (an int is accepted), `bool`, `str` and `Any`.
    A field with no default, or with the default `"???"` (omegaconf.MISSING), is required.
    """
    if isinstance(cfg, DictConfig | ListConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as e:
            raise _interpolation_error(e) from None
    return _build(cfg, schema, path)


def load_callable(reference: str, *, field: str) -> Callable[..., Any]:
    """'package.module:function' -> the function; errors name the config field and the value."""
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{field}={reference!r}: must be 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{field}={reference!r}: importing module {module_name!r} failed: {e}") from None
        # The job's processes import it too (an isolated environment's host): the module must be on the path of
        # every one, which is the job's working directory (`python -m` puts it first) and PYTHONPATH.
        raise ValueError(f"{field}={reference!r}: cannot import module {module_name!r} ({e}); the module must be "
                         "importable from the job's working directory or PYTHONPATH (add the folder that holds "
                         f"{module_name.split('.')[0]!r} to PYTHONPATH)") from None
    except Exception as e:  # the module itself is broken (a SyntaxError, an import it lacks, its own code raised)
        raise ValueError(f"{field}={reference!r}: importing module {module_name!r} failed: "
                         f"{type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{field}={reference!r}: module {module_name!r} has no callable {attr!r}")
    return fn


SECRET_SUFFIXES = ("api_key", "secret")  # a key so named is a credential: its value is never printed


def to_yaml(obj: Any) -> str:
    """YAML text of a config (DictConfig, dict or dataclass instance), interpolations resolved, credentials (keys
    ending in `SECRET_SUFFIXES`) shown as "<redacted>": apps print their config at start, into logs others read."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, DictConfig):
        obj = OmegaConf.to_container(obj, resolve=True)
    return OmegaConf.to_yaml(_redacted(obj), resolve=True)


def _redacted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<redacted>" if str(k).endswith(SECRET_SUFFIXES) and v is not None else _redacted(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


# ---- loading and overrides -------------------------------------------------------------------------


def _load_yaml(path: Path) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as e:  # also what OmegaConf raises for a file holding a lone scalar
        raise ConfigError(f"cannot read config file {str(path)!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, not a {type(cfg).__name__}")
    return cfg


def _apply_override(cfg: DictConfig, override: str) -> None:
    op = re.match(r"\+\+|\+|~|", override).group()
    key, eq, value = override[len(op) :].partition("=")
    if op == "~" and eq:
        raise ConfigError(f"override {override!r}: '~' deletes a key and takes no value; write ~{key}")
    if op != "~" and not eq:
        raise ConfigError(f"override {override!r} has no '='; write {key}=VALUE ({_OVERRIDE_HELP})")
    if not _KEY.fullmatch(key):
        raise ConfigError(
            f"override {override!r}: {key!r} is not a key; a key is dot-separated names such as trainer.lr"
        )
    exists = _has_key(cfg, key)
    # A plain `a.b=v` may set a key the file leaves to its schema default; a typo is still caught by
    # `validate`, which names the key and suggests the closest one.
    if op == "~" and not exists:
        raise ConfigError(f"override {override!r}: there is no key {key!r}.{_did_you_mean(key, _keys(cfg))}")
    if op == "+" and exists:
        raise ConfigError(f"override {override!r}: {key!r} already exists; to change it write {key}={value}")
    if op == "~":
        parent_key, _, name = key.rpartition(".")
        del (OmegaConf.select(cfg, parent_key) if parent_key else cfg)[name]
        return
    try:
        cfg.merge_with_dotlist([f"{key}={value}"])
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"override {override!r}: cannot set {key!r} to {value!r}: {_first_line(e)}") from None


def _has_key(cfg: DictConfig, key: str) -> bool:
    # Not OmegaConf.select(default=...): it reports a "???" value as absent.
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_resolution_failure=False) if parent_key else cfg
    return isinstance(parent, DictConfig) and name in parent.keys()


def _keys(cfg: DictConfig, prefix: str = "") -> Iterator[str]:
    """Every dotted key path in `cfg`, sections included."""
    for name, child in cfg.items_ex(resolve=False):
        key = f"{prefix}{name}"
        yield key
        if isinstance(child, DictConfig):
            yield from _keys(child, f"{key}.")


def _interpolation_error(e: OmegaConfBaseException) -> ConfigError:
    return ConfigError(f"{e.full_key}: cannot resolve interpolation: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    # OmegaConf appends "full_key: ..." and "object_type=..." lines; we name the key ourselves.
    return str(e).strip().splitlines()[0]


def _did_you_mean(key: str, candidates: Iterable[str]) -> str:
    """" Did you mean 'x'?" for the closest candidate, or "" when none is close."""
    close = difflib.get_close_matches(key, list(candidates), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


# ---- validation ------------------------------------------------------------------------------------


def _build(value: Any, tp: Any, path: str) -> Any:
    """`value` checked (and for dataclasses, constructed) as type `tp`; `path` names it in errors."""
    origin, args = get_origin(tp), get_args(tp)
    if isinstance(value, str) and value == MISSING:
        raise ConfigError(f"{path}: required value is missing (expected {_type_name(tp)}); set it with {path}=VALUE")
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{path}: schema type {tp} is not supported (only X | None unions are)")
        return _build(value, options[0], path)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(value, tp, path)
    if origin is Literal:
        # Compare types too: True == 1, but a bool is not the choice 1.
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
        raise ConfigError(f"{path}={value!r}: must be one of {', '.join(repr(a) for a in args)}")
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise _type_error(value, tp, path)
        item = args[0] if args else Any
        return [_build(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)) or (args and args[-1] is not Ellipsis and len(value) != len(args)):
            raise _type_error(value, tp, path)
        items = [args[0]] * len(value) if not args or args[-1] is Ellipsis else list(args)
        return tuple(_build(v, t if t is not Ellipsis else Any, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, items)))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _type_error(value, tp, path)
        item = args[1] if args else Any
        return {k: _build(v, item, f"{path}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        # bool is an int subclass, so an exact type check keeps `true` out of int fields.
        if type(value) is not tp:
            raise _type_error(value, tp, path)
        return value
    raise TypeError(f"{path}: schema type {tp} is not supported")


def _build_dataclass(value: Any, cls: type[T], path: str) -> T:
    if not isinstance(value, dict):
        raise _type_error(value, cls, path, expected=f"a mapping of {cls.__name__} fields")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = get_type_hints(cls)
    for key in value:
        if key not in fields:
            full = _join(path, key)
            suggestion = _did_you_mean(full, [_join(path, name) for name in fields])
            where = f" in {path}" if path else ""
            raise ConfigError(
                f"{full}={value[key]!r}: unknown key.{suggestion} Allowed keys{where}: {', '.join(fields)}"
            )
    kwargs = {}
    # In the config's own order: a key copied from an earlier one (`${rollout.temperature}`) is then reported
    # under the key the user wrote, which is checked first.
    for name in sorted(fields, key=lambda n: list(value).index(n) if n in value else len(value)):
        field, key = fields[name], _join(path, name)
        if name in value:
            kwargs[name] = _build(value[name], hints[name], key)
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = MISSING
        # Rebuild defaults that may hold "???" so a required value deep inside a section is reported too.
        if (isinstance(default, str) and default == MISSING) or dataclasses.is_dataclass(default):
            raw = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default
            kwargs[name] = _build(raw, hints[name], key)
        else:
            kwargs[name] = default
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(_with_path(str(e), cls, fields, path)) from None


def _with_path(message: str, cls: type, fields: dict, path: str) -> str:
    """A `__post_init__` message such as "max_policy_age=-1: must be >= 0" with the key path put in front."""
    message = message.removeprefix(f"{cls.__name__}.")
    head = re.match(r"\w+", message)
    if head and head.group() in fields:
        return _join(path, message)
    return f"{path}: {message}" if path else message


def _type_error(value: Any, tp: Any, path: str, expected: str = "") -> ConfigError:
    expected = expected or _type_name(tp)
    return ConfigError(f"{path}={value!r}: expected {expected}, got {type(value).__name__}")


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
