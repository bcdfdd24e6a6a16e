"""Aggregation modes: hand values, and the same loss and gradient when a step is split into 1, 2 or 4 micro-batches."""

import pytest
import torch

from mrl.algo.aggregation import LOSS_AGG_MODES, LossNormalizer, agg_loss, loss_counts


def test_modes_by_hand_and_no_op_rows_do_not_count():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [100.0, 100.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is a synthetic no-op sample
    expected = {
        "token-mean": (1 + 2 + 4) / 3,
        "seq-mean-token-sum": (3 + 4) / 2,
        "seq-mean-token-mean": (1.5 + 4) / 2,
        "seq-mean-token-sum-norm": (3 + 4) / (2 * 3),
    }
    for mode, value in expected.items():
        assert agg_loss(loss, mask, mode, loss_scale_factor=3).item() == pytest.approx(value), mode
    assert LossNormalizer.from_mask(mask) == LossNormalizer(num_tokens=3.0, num_seqs=2.0)


def test_all_masked_step_gives_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3), mode).item() == 0.0


def _step_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(8, 7, generator=gen, dtype=torch.float64)
    lengths = [7, 1, 4, 0, 6, 2, 5, 3]  # uneven, so per-micro-batch means differ from the step mean
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    return loss, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("num_micro_batches", [1, 2, 4])
def test_sum_of_micro_batch_shares_equals_full_batch_loss_and_gradient(mode: str, num_micro_batches: int):
    loss, mask = _step_batch()
    full_leaf = loss.clone().requires_grad_(True)
    full = agg_loss(full_leaf, mask, mode, loss_scale_factor=7)
    full.backward()

    # What the engine does: count every micro-batch (and, across DP ranks, all-reduce), then sum the shares.
    chunks = list(zip(loss.chunk(num_micro_batches), mask.chunk(num_micro_batches)))
    normalizer = LossNormalizer.from_counts(sum(loss_counts(m) for _, m in chunks))
    leaves = [chunk.clone().requires_grad_(True) for chunk, _ in chunks]
    total = sum(agg_loss(leaf, m, mode, normalizer, loss_scale_factor=7) for leaf, (_, m) in zip(leaves, chunks))
    total.backward()

    torch.testing.assert_close(total, full)
    torch.testing.assert_close(torch.cat([leaf.grad for leaf in leaves]), full_leaf.grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_per_micro_batch_normalisation_would_be_wrong(mode: str):
    """The reason global normalisers exist: averaging per-micro-batch means does not give the step loss."""
    loss, mask = _step_batch()
    full = agg_loss(loss, mask, mode)
    naive = sum(agg_loss(c, m, mode) for c, m in zip(loss.chunk(4), mask.chunk(4))) / 4
    assert not torch.isclose(naive, full)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="loss_agg_mode 'mean'"):
        agg_loss(torch.ones(1, 1), torch.ones(1, 1), "mean")
