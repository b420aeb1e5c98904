"""Every public name of covrl.math runs on small inputs and returns the documented shapes."""

import torch

import covrl.math as cm

torch.set_num_threads(1)


def test_public_api_shapes():
    g = torch.Generator().manual_seed(0)
    B, T, V = 4, 5, 11
    z = torch.randn(B, T, V, generator=g, requires_grad=True)
    y = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    lp = cm.token_logprobs(z, y, 0.7)
    assert lp.shape == (B, T) and lp.dtype == torch.float32
    assert cm.token_logprobs(z, y[..., None].expand(B, T, 3)).shape == (B, T, 3)
    assert cm.entropy_from_logits(z).shape == (B, T)
    s = cm.sum_pi_squared(z, 0.7)
    assert cm.logit_grad_proxy(lp, s).shape == (B, T)
    for name in cm.ADVANTAGE_ESTIMATORS:
        out = cm.compute_advantages(name, rewards=torch.tensor([1.0, 0, 1, 0]), mask=mask,
                                    group_ids=torch.tensor([0, 0, 1, 1]), logprobs=lp.detach(), sum_pi_sq=s.detach())
        assert out.advantages.shape == (B, T) and out.returns.shape == (B, T)
        assert "adv/frac_zero_std_groups" in out.metrics
    for name in cm.POLICY_LOSSES:
        out = cm.policy_loss(name, logprobs=lp, sampler_logprobs=lp.detach() + 0.1,
                             advantages=torch.randn(B, T, generator=g), mask=mask)
        assert out.loss.dim() == 0 and out.token_loss.shape == (B, T)
        out.loss.backward(retain_graph=True)
    c = cm.rollout_correction(lp, lp.detach() + 0.1, mask, cm.CorrectionConfig(is_level="token"))
    assert c.weights.shape == (B, T) and c.keep.shape == (B, T)
    for kind in cm.KL_ESTIMATORS:
        assert cm.kl_estimate(lp, lp + 0.1, kind).shape == (B, T)
