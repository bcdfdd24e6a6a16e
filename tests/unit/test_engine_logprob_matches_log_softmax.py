"""Chunked log-probs and entropy from hidden states equal log_softmax / entropy of the materialised logits, in
values and in gradients w.r.t. hidden states and output weight (fp32, 1e-5), whatever the chunk size, with the
logits kept for the backward pass or recomputed there, and with the backward split into several vocabulary blocks
(vocab 300 > one 128-column block); also with the elementwise kernels compiled on CPU (`megatron.compile_fusions`)."""

import pytest
import torch

from mrl.engine.megatron.logprob import vocab_parallel_logprobs


def reference(h, w, labels):
    logits = h @ w.t()
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def check(chunk: int, use_entropy: bool, keep_logits: bool, compiled: bool | None = None) -> None:
    torch.manual_seed(chunk)
    t, hidden, vocab = 19, 16, 300
    h = torch.randn(t, hidden, dtype=torch.float64).float().requires_grad_()
    w = (0.5 * torch.randn(vocab, hidden)).requires_grad_()
    labels = torch.randint(0, vocab, (t,))
    g1, g2 = torch.randn(t), torch.randn(t)

    logp, ent = vocab_parallel_logprobs(
        h, w, labels, chunk_tokens=chunk, keep_logits_bytes=1 << 30 if keep_logits else 0, compiled=compiled
    )
    ((logp * g1).sum() + (ent * g2).sum() if use_entropy else (logp * g1).sum()).backward()
    got = (logp.detach(), ent.detach(), h.grad.clone(), w.grad.clone())

    h.grad = w.grad = None
    ref_logp, ref_ent = reference(h, w, labels)
    ((ref_logp * g1).sum() + (ref_ent * g2).sum() if use_entropy else (ref_logp * g1).sum()).backward()
    for a, b in zip(got, (ref_logp.detach(), ref_ent.detach(), h.grad, w.grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 1024])
@pytest.mark.parametrize("use_entropy", [False, True])
@pytest.mark.parametrize("keep_logits", [True, False])
def test_values_and_gradients_match_full_logits(chunk, use_entropy, keep_logits):
    check(chunk, use_entropy, keep_logits)


@pytest.mark.parametrize("keep_logits", [True, False])
def test_compiled_elementwise_kernels_on_cpu_match_full_logits(keep_logits):
    from mrl.engine.megatron import logprob

    calls = logprob._compiled.cache_info()
    check(7, True, keep_logits, compiled=True)
    after = logprob._compiled.cache_info()
    # both kernels (forward sums, logit gradient) were taken from the compiled path
    assert after.hits + after.misses - calls.hits - calls.misses == 2
