"""The clipped critic loss, by hand: which branch is taken, its value and its gradient."""

import pytest
import torch

from mrl.algo.value_loss import clipped_value_loss


def test_clipped_value_loss_takes_the_larger_branch():
    vpreds = torch.tensor([[1.5, 1.1, 0.5, 9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 2.0, 0.9, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    out = clipped_value_loss(vpreds, old, returns, mask, cliprange_value=0.2)
    # 1.5 → V_clip 1.2: ½·max(0.25, 0.64) | 1.1 inside the band: ½·0.81 | 0.5 → V_clip 0.8: ½·max(0.16, 0.01) | masked
    torch.testing.assert_close(out.loss_mat, torch.tensor([[0.32, 0.405, 0.08, 0.0]], dtype=torch.float64))
    out.loss_mat.sum().backward()
    # the clipped branch is constant in V; the others give V − R
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, -0.9, -0.4, 0.0]], dtype=torch.float64))
    assert out.metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert out.metrics["vpred_mean"].item() == pytest.approx((1.5 + 1.1 + 0.5) / 3)
