"""Keys of the free-form dicts, checked against what the installed engine or Megatron accepts.

`rollout.engine_kwargs` goes to the inference engine verbatim and `*.megatron.override_transformer_config` to
Megatron's `TransformerConfig`; a key they do not know would fail deep inside a worker (or be dropped). The
accepted names are read from the installed packages (dataclass or pydantic fields), never listed here, so an
upgrade changes them with it. An engine that is not installed here is checked the same way when its replica starts
(`mrl/rollout/server.py`), where it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any

from mrl.config.engine_fields import ADAPTER_ENGINE_KWARGS
from mrl.config.errors import ConfigError, Violation

# Where each backend's engine arguments are declared: (module, class) candidates, first importable wins.
ENGINE_ARG_CLASSES: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm": (("vllm.engine.arg_utils", "AsyncEngineArgs"),),
    "trtllm": (("tensorrt_llm.llmapi.llm_args", "TorchLlmArgs"), ("tensorrt_llm.llmapi", "LlmArgs")),
}


def _field_names(cls: type) -> frozenset[str]:
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    return frozenset(getattr(cls, "model_fields", None) or {})  # pydantic (TensorRT-LLM's LlmArgs)


@cache
def engine_arguments(backend: str) -> frozenset[str] | None:
    """The engine-argument names `backend` accepts here; None when its engine is not installed."""
    if backend in ADAPTER_ENGINE_KWARGS:  # their adapters, not engine classes, take the keys
        return frozenset(ADAPTER_ENGINE_KWARGS[backend])
    for module, name in ENGINE_ARG_CLASSES.get(backend, ()):
        try:
            with _quiet_import():
                return _field_names(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return None


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """Import an engine without its import-time chatter (vLLM configures its loggers on import unless told not
    to; the environment is restored, so engines started later in this process log as usual)."""
    saved = os.environ.get("VLLM_CONFIGURE_LOGGING")
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    engine_log = logging.getLogger("vllm")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        engine_log.setLevel(level)
        if saved is None:
            os.environ.pop("VLLM_CONFIGURE_LOGGING", None)
        else:
            os.environ["VLLM_CONFIGURE_LOGGING"] = saved


@cache
def transformer_config_fields() -> frozenset[str]:
    with _quiet_import():  # megatron.core warns at import that TE and Apex are missing
        from megatron.core.transformer.transformer_config import TransformerConfig
    return _field_names(TransformerConfig)


def _unknown(setting: str, keys: Iterable[str], known: frozenset[str], values: dict[str, Any],
             owner: str) -> Iterator[Violation]:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            yield Violation(f"{setting}.{key}", values[key], f"not an argument {owner} accepts{hint}")


def engine_kwargs_violations(backend: str, engine_kwargs: dict[str, Any]) -> list[Violation]:
    """Keys of `rollout.engine_kwargs` the backend does not take (none checked when it is not installed)."""
    known = engine_arguments(backend) if engine_kwargs else frozenset()
    if known is None:
        return []
    owner = {"hf": "the hf backend (it takes no engine arguments)",
             "sglang": "the sglang adapter (extra_args passes server flags)"}.get(backend, f"{backend}'s engine")
    return list(_unknown("rollout.engine_kwargs", engine_kwargs, known, engine_kwargs, owner))


def require_engine_kwargs(backend: str, engine_kwargs: dict[str, Any]) -> None:
    """At a replica's start, where the engine is installed: the same one-line error as at start-up."""
    violations = engine_kwargs_violations(backend, engine_kwargs)
    if violations:
        raise ConfigError(violations)


def transformer_config_violations(role: str, overrides: dict[str, Any], named: Iterable[str]) -> list[Violation]:
    """Keys of `<role>.megatron.override_transformer_config` that TransformerConfig lacks, or that a named
    setting of `<role>.megatron` already owns (the named one would be silently overridden)."""
    if not overrides:
        return []
    setting = f"{role}.megatron.override_transformer_config"
    out = [Violation(f"{setting}.{k}", overrides[k], f"a named setting: set {role}.megatron.{k} instead")
           for k in overrides if k in set(named)]
    rest = [k for k in overrides if k not in set(named)]
    return out + list(_unknown(setting, rest, transformer_config_fields(), overrides, "Megatron's TransformerConfig"))
