"""Which keys a configuration may hold, derived from the dataclasses of `mrl/config/schema.py`.

Every named setting is a dataclass field; the only free-form places are fields typed `dict[str, Any]`
(`rollout.engine_kwargs`, `*.megatron.override_transformer_config`), whose keys belong to the engine or to
Megatron and are checked against them (mrl/config/passthrough.py). Command-line overrides are checked here before
Hydra composes anything, so a typo is one line naming the nearest valid key rather than Hydra's hint to add `+`,
which would be accepted and then ignored. Nothing here lists fields by hand: fields added later are covered.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from functools import cache
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException

from mrl.config.errors import Violation
from mrl.config.schema import MrlConfig

# Hydra's own settings (hydra.run.dir=…) and groups are Hydra's business, not the schema's.
_HYDRA_PREFIX = "hydra"


def _is_free_form(tp: Any) -> bool:
    return typing.get_origin(tp) is dict


@cache
def schema_fields(root: type = MrlConfig) -> dict[str, Any]:
    """{dotted path: annotated type} of every field, sections included (a section's type is its dataclass)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(root):
        out[f.name] = f.type
        if dataclasses.is_dataclass(f.type):
            out.update({f"{f.name}.{k}": v for k, v in schema_fields(f.type).items()})  # type: ignore[arg-type]
    return out


def free_form_dicts() -> list[str]:
    return [path for path, tp in schema_fields().items() if _is_free_form(tp)]


def free_form_parent(path: str) -> str | None:
    """The free-form dict field that `path` lies inside (`rollout.engine_kwargs` for `rollout.engine_kwargs.x`)."""
    return next((d for d in free_form_dicts() if path.startswith(d + ".")), None)


def nearest(path: str) -> str | None:
    """The valid key a typo most likely meant: a sibling first (same section), else any key."""
    fields = schema_fields()
    parent, _, name = path.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in fields if k.rpartition(".")[0] == parent}
    initials = "".join(word[0] for word in name.split("_") if word)
    if len(initials) > 1 and initials in siblings:  # learning_rate -> lr
        return siblings[initials]
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.5)
    if close:
        return siblings[close[0]]
    close = difflib.get_close_matches(path, list(fields), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key(path: str, value: Any) -> Violation:
    guess = nearest(path)
    hint = f"; did you mean {guess}?" if guess else ""
    return Violation(path, value, f"unknown setting{hint} (a '+' prefix adds keys only inside the free-form dicts "
                                  f"{', '.join(sorted(set(p.rpartition('.')[2] for p in free_form_dicts())))})")


def _value(override: Override) -> Any:
    return override.value() if not override.is_delete() else None


def check_overrides(overrides: list[str]) -> tuple[list[str], list[Violation]]:
    """(the overrides to compose, violations). A key inside a free-form dict may be set with or without `+`
    (it is composed as `++key=value`); anywhere else the key must be a field, and `+` is refused."""
    fields = schema_fields()
    parser = OverridesParser.create()
    out, violations = [], []
    for raw in overrides:
        try:
            (o,) = parser.parse_overrides([raw])
        except OverrideParseException as err:  # Hydra's grammar: key=value, +key=value, ~key
            key, _, value = raw.partition("=")
            reason = next((ln.strip() for ln in str(err).splitlines() if ln.strip().strip("^")
                           and not ln.startswith(("See ", "Error parsing"))), "see Hydra's override grammar")
            violations.append(Violation(key.lstrip("+~") or "override", value or None,
                                        f"not a key=value override ({reason})"))
            continue
        key = o.key_or_group
        if not key:
            violations.append(Violation("override", raw, "names no setting: write key=value"))
        elif key.split(".")[0] == _HYDRA_PREFIX or o.is_delete():
            out.append(raw)
        elif free_form_parent(key) is not None:
            out.append(f"++{key}={o.get_value_element_as_str()}")
        elif key not in fields:
            violations.append(unknown_key(key, _value(o)))
        elif o.is_add() or o.is_force_add():
            violations.append(Violation(key, _value(o), f"'+' adds keys only inside free-form dicts; {key} is a "
                                                        f"setting: write {key}=…"))
        else:
            out.append(raw)
    return out, violations


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def composition_violation(err: BaseException, overrides: list[str], recipe_values: Any) -> Violation | None:
    """The setting and rule behind a Hydra composition error (a recipe's unknown key, a value of the wrong type),
    found on OmegaConf's exception in the chain; None when there is none (then the error is not the user's)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause: BaseException | None = err
    while cause is not None and not (isinstance(cause, OmegaConfBaseException) and cause.full_key):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    key = str(cause.full_key)  # type: ignore[attr-defined]
    value = _override_value(key, overrides, recipe_values)
    if isinstance(cause, ConfigKeyError | ConfigAttributeError):
        return unknown_key(key, value)
    section = getattr(cause, "object_type", None)
    item = _list_item(key, section, overrides, recipe_values)
    if item is not None:
        tp = {f.name: f.type for f in dataclasses.fields(section)}.get(key)
        key, value = item
    else:
        tp = schema_fields().get(key)
    expected = f"must be {_type_name(tp)}" if tp is not None else "has the wrong type"
    return Violation(key, value, f"{expected} ({str(cause.msg).splitlines()[0]})")  # type: ignore[attr-defined]


def _list_item(name: str, section: Any, overrides: list[str], recipe_values: Any) -> tuple[str, Any] | None:
    """(`reward.models[i].name`, value) of a list-of-sections item whose field `name` OmegaConf refused: it reports
    such a field without its list path. The item is the first whose value does not fit the section's type."""
    from omegaconf import OmegaConf

    lists = [path for path, tp in schema_fields().items()
             if typing.get_origin(tp) is list and typing.get_args(tp) == (section,)]
    for path in lists:
        for i, entry in enumerate(_override_value(path, overrides, recipe_values) or []):
            if not hasattr(entry, "keys") or name not in entry:
                continue
            try:
                OmegaConf.merge(OmegaConf.structured(section), {name: entry[name]})
            except Exception:
                return f"{path}[{i}].{name}", entry[name]
    return None


def _override_value(key: str, overrides: list[str], recipe_values: Any) -> Any:
    from omegaconf import OmegaConf

    for o in reversed(OverridesParser.create().parse_overrides(overrides)):
        if o.key_or_group.lstrip("+") == key:
            return _value(o)
    return OmegaConf.select(recipe_values, key, default=None) if recipe_values is not None else None


def unknown_in(cfg: Any, root: type = MrlConfig, prefix: str = "") -> list[Violation]:
    """Keys of a composed config that are no field (however they got there); free-form dicts are skipped."""
    from omegaconf import DictConfig

    out = []
    names = {f.name: f.type for f in dataclasses.fields(root)}
    for key in cfg:
        path, value = f"{prefix}{key}", cfg[key]
        if key not in names:
            out.append(unknown_key(path, value))
        elif dataclasses.is_dataclass(names[key]) and isinstance(value, DictConfig):
            out += unknown_in(value, names[key], f"{path}.")
    return out
