"""Packed-row RoPE in one pass (mrl/engine/megatron/rope.py) equals Megatron's per-document loop bit for bit, in
values and gradients, for full and partial rotary dimensions; positions restart at 0 in every document."""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from mrl.engine.megatron import cpu_compat, rope
from mrl.utils.distributed import free_port

LENGTHS = [5, 1, 17, 9, 3]


@pytest.fixture(scope="module")
def cp_group():
    # A real one-rank gloo group stands in for the context-parallel group: RoPE only asks for its size and rank.
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    if own:
        dist.destroy_process_group()


def test_positions_restart_in_every_document():
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    assert rope.positions_in_documents(cu, 6).tolist() == [0, 1, 2, 0, 0, 1]


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_one_pass_equals_megatron_per_document_loop(cp_group, rotary_percent):
    cpu_compat.apply()  # RotaryEmbedding builds its frequencies on the current (CUDA) device otherwise
    rope.install()
    megatron_loop = rope._megatron_thd
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_rotary_pos_emb_thd
    heads, dim = 4, 16
    freqs = RotaryEmbedding(dim, rotary_percent=rotary_percent, rotary_base=10000)(max(LENGTHS))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENGTHS), heads, dim, generator=g)
    grad_out = torch.randn(x.shape, generator=g)

    def run(fn):
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf, cu, freqs, cp_group=cp_group)
        out.backward(grad_out)
        return out.detach(), leaf.grad

    ours, ours_grad = run(rope.apply_rotary_pos_emb_thd)
    ref, ref_grad = run(megatron_loop)
    assert torch.equal(ours, ref) and torch.equal(ours_grad, ref_grad)
    # Each document is rotated from position 0: the last one alone gives the same values.
    last = x[-LENGTHS[-1]:]
    alone = rope_utils._apply_rotary_pos_emb_bshd(last.unsqueeze(1), freqs[: LENGTHS[-1]]).squeeze(1)
    assert torch.equal(ours[-LENGTHS[-1]:], alone)
    assert not torch.equal(ours, x)  # it did rotate
