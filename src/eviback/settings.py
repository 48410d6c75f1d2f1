"""Setting values checked against the type of the config dataclass field they fill.

The settings of a run come as text (`--set key=value` of `eviback train`, `demo` and `sft`) or as YAML values
(presets, `--config` files, an experiment's `settings`), and fill config dataclasses whose fields are typed
(`lam: float`, `eval_benchmarks: list[str]`, `data: str | None`). A value of the wrong type used to travel
until something used it (`--set lam=abc` reached `math.isfinite` and raised a TypeError); here it is refused
where it is read, with a message that names the setting and the type it takes::

    parse_setting_value("lam", "abc", float)
    # ValueError: --set lam=abc: setting 'lam' takes a number (float), got 'abc'
    check_setting("eval_benchmarks", "nq", list[str])  # ['nq']

Conversions, and only these:

- an integer where a float is expected (`lam=1` is 1.0);
- a numeric string where a float is expected (YAML reads `learning_rate: 1e-6` as a string);
- a single value where a list is expected (`eval_benchmarks=nq` is `[nq]`);
- a number or a path where a string is expected (`data: 2024` in YAML is the string "2024"); on the command
  line a string setting takes the text as written (`--set teacher=on` is "on", not YAML's `True`);
- an enum's value where the enum is expected (`mode: grpo` is `Mode.GRPO`);
- a string where a path is expected (`out: results/x` is `Path("results/x")`).

A type not named here (a config section, another dataclass) is left to the dataclass that holds the value, which
knows how the user builds it.

Anything else of the wrong type is refused: `max_steps=2.5`, `warm_start=1`, `lam=abc`, `teacher=` (nothing,
where a string is required).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import types
import typing
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

import yaml

_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Each field of the dataclass `cls` with its type (string annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _options(tp: Any) -> tuple[Any, ...] | None:
    """The members of a union type (`str | None`), or None for another type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def type_name(tp: Any) -> str:
    """How a message names the type: `a number (float)`, `a list of strings (list[str])`."""
    options = _options(tp)
    if options is not None:
        words = [_WORDS.get(a, getattr(a, "__name__", str(a))) for a in options if a is not type(None)]
        nullable = " or null" if type(None) in options else ""
        spelled = " | ".join(getattr(a, "__name__", str(a)) for a in options).replace("NoneType", "None")
        return f"{' or '.join(words)}{nullable} ({spelled})"
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        item = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        spelled = getattr(item, "__name__", str(item))
        return f"a list of {_PLURALS.get(item, spelled)} ({origin.__name__}[{spelled}])"
    if tp in _WORDS:
        return f"{_WORDS[tp]} ({tp.__name__})"
    if _is_class(tp, enum.Enum):
        return f"one of {', '.join(str(m.value) for m in tp)} ({tp.__name__})"
    if _is_class(tp, PurePath):
        return f"a path ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _is_class(tp: Any, base: type) -> bool:
    return isinstance(tp, type) and issubclass(tp, base)


def _refuse(name: str, value: Any, tp: Any) -> ValueError:
    got = "nothing" if value is None else repr(value)
    return ValueError(f"setting {name!r} takes {type_name(tp)}, got {got}")


def check_setting(name: str, value: Any, tp: Any) -> Any:
    """`value` as a value of the type `tp` of the setting `name`, converted only as the module doc says;
    raises ValueError naming the setting and the type when it is not one."""
    return _check(name, value, tp, name, tp)


def _check(name: str, value: Any, tp: Any, setting: str, declared: Any) -> Any:
    # `setting` and `declared` are the whole setting's, for the message when an item of a list is wrong
    if tp is Any:
        return value
    options = _options(tp)
    if options is not None:
        if value is None:
            if type(None) in options:
                return None
            raise _refuse(setting, value, declared)
        for option in (a for a in options if a is not type(None)):
            try:
                return _check(name, value, option, setting, declared)
            except ValueError:
                continue
        raise _refuse(setting, value, declared)
    if value is None:
        raise _refuse(setting, value, declared)
    origin = typing.get_origin(tp)
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, Mapping):
            raise _refuse(setting, value, declared)
        item = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        values = value if isinstance(value, list | tuple) else [value]  # one value is a list of one
        checked = [_check(f"{name}[{i}]", v, item, setting, declared) for i, v in enumerate(values)]
        return tuple(checked) if (origin or tp) is tuple else checked
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    elif origin is dict or tp is dict:
        if isinstance(value, Mapping):
            return dict(value)
    elif _is_class(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)  # by its value: `mode: grpo` is Mode.GRPO
        except (ValueError, TypeError):
            pass
    elif _is_class(tp, PurePath):
        if isinstance(value, tp):
            return value
        if isinstance(value, str | os.PathLike):
            return tp(value)
    else:
        return value  # a type this module does not know: the dataclass validates it
    raise _refuse(setting, value, declared)


def _takes_text(tp: Any) -> bool:
    options = _options(tp)
    return tp is str or (options is not None and str in options)


def parse_setting_value(name: str, text: str, tp: Any) -> Any:
    """The value of `--set name=text` for a setting of type `tp`: the text read as YAML (`0.5`, `[nq, popqa]`,
    `null`), except that a string setting takes the text as written when YAML would read another scalar;
    then checked by :func:`check_setting`. Raises ValueError naming `--set name=text`, the setting and its
    type."""
    text = text.strip()
    where = f"--set {name}={text}"
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError as e:
        if not _takes_text(tp):
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ValueError(f"{where}: not a valid value for setting {name!r}, which takes {type_name(tp)} "
                             f"({problem})") from None
        value = text  # a string setting: a path or a name with characters YAML reads specially
    if _takes_text(tp) and value is not None and not isinstance(value, str | list | tuple | dict):
        value = text  # `teacher=on` is the name "on", not YAML's True; `model=1.10` keeps its zero
    try:
        return check_setting(name, value, tp)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def check_values(types: Mapping[str, Any], values: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """`values` with each setting named in `types` (setting name -> type) checked by :func:`check_setting`;
    other keys are left as they are, for the caller to refuse by name. A message is prefixed by `where`
    when given."""
    out = dict(values)
    for key, value in values.items():
        if key in types:
            try:
                out[key] = check_setting(key, value, types[key])
            except ValueError as e:
                raise ValueError(f"{where}: {e}" if where else str(e)) from None
    return out


def check_fields(instance: Any) -> None:
    """Check (and convert in place) every field of a dataclass instance against its type; for a config's
    `__post_init__`, so that a config built any way (a file, a resumed run's config.yaml, code) is typed."""
    for name, tp in field_types(type(instance)).items():
        value = getattr(instance, name)
        checked = check_setting(name, value, tp)
        if checked is not value:
            object.__setattr__(instance, name, checked)
