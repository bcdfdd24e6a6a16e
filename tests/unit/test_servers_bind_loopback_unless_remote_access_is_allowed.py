"""Inference servers listen on loopback by default, and every way to put one elsewhere needs the explicit opt-out
`rollout.allow_remote_access`: the config (rollout.server_host), the replica spec, SGLang's launch command, an
SGLang `--host` smuggled through extra_args, a remote SGLang base_url, and vLLM's Mooncake PD connector (which
binds 0.0.0.0 itself)."""

from __future__ import annotations

import re

import pytest

from mrl.config import ConfigError, MrlConfig
from mrl.config.startup import validate
from mrl.rollout.pd import PDSpec
from mrl.rollout.pd_members import PDReplica
from mrl.rollout.replica import ReplicaSpec, RolloutReplica
from mrl.utils.network import is_loopback, require_loopback
from rollout_adapters.sglang import protocol
from rollout_adapters.sglang.adapter import SGLangAdapter


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("no-such-host.invalid")
    require_loopback("10.1.2.3", "x", allow_remote_access=True)
    with pytest.raises(ValueError, match=r"x='10.1.2.3' is not a loopback address.*rollout.allow_remote_access"):
        require_loopback("10.1.2.3", "x", allow_remote_access=False)


def config(**rollout) -> MrlConfig:
    cfg = MrlConfig()
    cfg.model.path = "unused"
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    return cfg


def test_config_refuses_a_non_loopback_server_host_without_the_opt_out():
    validate(config(), check_paths=False)
    with pytest.raises(ConfigError) as info:
        validate(config(server_host="0.0.0.0"), check_paths=False)
    assert [v.setting for v in info.value.violations] == ["rollout.server_host"]
    assert "rollout.allow_remote_access=true" in str(info.value)
    validate(config(server_host="0.0.0.0", allow_remote_access=True), check_paths=False)


def test_replica_spec_puts_the_engine_on_loopback_and_refuses_elsewhere():
    spec = ReplicaSpec(backend="hf", model_path="unused")
    env = spec.server_env()
    assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert spec.adapter_kwargs()["host"] == "127.0.0.1" and spec.adapter_kwargs()["allow_remote_access"] is False
    with pytest.raises(ValueError, match=re.escape("rollout.server_host='0.0.0.0'")):
        RolloutReplica(0, ReplicaSpec(backend="hf", model_path="unused", host="0.0.0.0"), "standalone")
    exposed = ReplicaSpec(backend="hf", model_path="unused", host="10.1.2.3", allow_remote_access=True)
    assert RolloutReplica(0, exposed, "standalone").spec.server_env()["VLLM_HOST_IP"] == "10.1.2.3"


def test_sglang_launch_binds_loopback_and_refuses_other_addresses():
    argv = protocol.server_command("/m", port=30000)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    adapter = SGLangAdapter("/m")
    assert adapter.host == "127.0.0.1"
    with pytest.raises(ValueError, match=re.escape("rollout.server_host='0.0.0.0'")):
        SGLangAdapter("/m", host="0.0.0.0")
    assert SGLangAdapter("/m", host="0.0.0.0", allow_remote_access=True).host == "0.0.0.0"
    for extra in (["--host", "0.0.0.0"], ["--host=0.0.0.0"]):
        with pytest.raises(ValueError, match=r"engine_kwargs\.host: set rollout\.server_host"):
            SGLangAdapter("/m", engine_kwargs={"extra_args": extra}, allow_remote_access=True)
    with pytest.raises(ValueError, match=re.escape("base_url host='10.1.2.3'")):
        SGLangAdapter("/m", base_url="http://10.1.2.3:30000")
    assert SGLangAdapter("/m", base_url="http://localhost:30000").base_url == "http://localhost:30000"


def test_vllm_mooncake_pd_needs_the_opt_out():
    spec = ReplicaSpec(backend="vllm", model_path="unused")
    with pytest.raises(ValueError, match=re.escape("bootstrap server binds 0.0.0.0")):
        PDReplica(0, spec, PDSpec(transfer_backend="mooncake"))
    PDReplica(0, spec, PDSpec(transfer_backend="nixl"))
    PDReplica(0, ReplicaSpec(backend="vllm", model_path="unused", allow_remote_access=True),
              PDSpec(transfer_backend="mooncake"))
