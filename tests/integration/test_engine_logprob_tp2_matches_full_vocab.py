"""Vocab-parallel log-probs at TP=2 (each rank holds half the output rows, real gloo all-reduces) equal
log_softmax of the full logits on one process, in values and in gradients (fp32, 1e-5); on NCCL where CUDA is
present."""

import pytest
import torch

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration

T, HIDDEN, VOCAB = 23, 16, 64


def data():
    g = torch.Generator().manual_seed(7)
    h = torch.randn(T, HIDDEN, generator=g)
    w = 0.5 * torch.randn(VOCAB, HIDDEN, generator=g)
    labels = torch.randint(0, VOCAB, (T,), generator=g)
    g1, g2 = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return h, w, labels, g1, g2


def run_shard(rank: int, world: int):
    import torch.distributed as dist

    from mrl.engine.megatron.logprob import vocab_parallel_logprobs
    from mrl.engine.megatron.parallel import init_distributed

    init_distributed()
    try:
        # NCCL (CUDA present) takes device tensors only; gloo takes CPU ones.
        device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
        h, w, labels, g1, g2 = (x.to(device) for x in data())
        rows = VOCAB // world
        h = h.clone().requires_grad_()
        w_local = w[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        logp, ent = vocab_parallel_logprobs(
            h, w_local, labels, tp_group=dist.group.WORLD, vocab_start=rank * rows, chunk_tokens=5
        )
        ((logp * g1).sum() + (ent * g2).sum()).backward()
        grad_h = h.grad.clone()
        dist.all_reduce(grad_h)  # what copy_to_tensor_model_parallel_region's backward does
        # numpy, not tensors: torch's queue pickling shares storage by fd, which dies with the child process
        return tuple(t.detach().cpu().numpy() for t in (logp, ent, grad_h, w_local.grad))
    finally:
        dist.destroy_process_group()


def test_tp2_logprobs_and_grads_equal_full_vocab():
    results = launch(run_shard, 2, timeout_s=120)
    h, w, labels, g1, g2 = data()
    h.requires_grad_()
    w.requires_grad_()
    logp_all = torch.log_softmax(h @ w.t(), -1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * g1).sum() + (ent * g2).sum()).backward()
    for rank, arrays in enumerate(results):
        r_logp, r_ent, r_gh, r_gw = (torch.from_numpy(a) for a in arrays)
        torch.testing.assert_close(r_logp, logp.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r_ent, ent.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r_gh, h.grad, atol=1e-5, rtol=1e-5)
        rows = VOCAB // 2
        torch.testing.assert_close(r_gw, w.grad[rank * rows : (rank + 1) * rows], atol=1e-5, rtol=1e-5)
