"""The head loss shared by head pretraining and the slow path: weights and the proximal term."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specroll.models import build_tiny_model
from specroll.speculation import HorizonHeads
from specroll.speculation.head_training.loss import (
    HeadBatch,
    HeadLossConfig,
    head_loss,
    head_states,
    sparse_kl,
    sparse_kl_and_nll,
    train_step,
)
from specroll.speculation.head_training.samples import SampledSequence
from specroll.speculation.head_training.targets import SparseDistribution, compute_targets, sparse_distribution
from specroll.speculation.head_training.training import HeadTrainConfig

# q_new = softmax(log(0.2, 0.3, 0.5) + 7) = (0.2, 0.3, 0.5): the shift checks the normaliser.
Q_NEW = torch.log(torch.tensor([[0.2, 0.3, 0.5]])) + 7


def sparse(probs: list[float], ids: list[int], tail: float) -> SparseDistribution:
    return SparseDistribution(torch.log(torch.tensor([probs])), torch.tensor([ids]), torch.log(torch.tensor([tail])))


def test_proximal_kl_matches_hand_worked_cases():
    # q_old kept as top-2 (token 2: 0.6, token 0: 0.3) + tail (token 1: 0.1), the whole support:
    # KL = 0.6 ln(0.6/0.5) + 0.3 ln(0.3/0.2) + 0.1 ln(0.1/0.3)
    #    = 0.6 * 0.1823216 + 0.3 * 0.4054651 + 0.1 * (-1.0986123) = 0.1093929 + 0.1216395 - 0.1098612 = 0.1211712
    q_old = sparse([0.6, 0.3], [2, 0], 0.1)
    assert sparse_kl(Q_NEW, q_old).item() == pytest.approx(0.1211712, abs=1e-6)
    # Top-1 (token 2: 0.6) + tail 0.4, against q_new's mass outside token 2, 0.5:
    # KL = 0.6 ln(0.6/0.5) + 0.4 ln(0.4/0.5) = 0.1093929 - 0.0892574 = 0.0201355 (<= the full KL above).
    q_old = sparse([0.6], [2], 0.4)
    assert sparse_kl(Q_NEW, q_old).item() == pytest.approx(0.0201355, abs=1e-6)
    # q_old = q_new: zero.
    assert sparse_kl(Q_NEW, sparse_distribution(Q_NEW, top_k=2)).item() == pytest.approx(0.0, abs=1e-6)


def test_head_loss_weighs_its_terms():
    # p: top-1 (token 0: 0.5) + tail 0.5; q_new's tail is 0.8: KL(p || q) = 0.5 ln(0.5/0.2) + 0.5 ln(0.5/0.8) = ln 1.25
    # = 0.2231436. Sampled token 1: NLL = -ln 0.3 = 1.2039728. q_old as in the first case above: 0.1211712.
    p, token, q_old = sparse([0.5], [0], 0.5), torch.tensor([1]), sparse([0.6, 0.3], [2, 0], 0.1)
    kl, nll = sparse_kl_and_nll(Q_NEW, *p, token)
    assert (kl.item(), nll.item()) == pytest.approx((0.2231436, 1.2039728), abs=1e-6)
    # Pretraining, 1 KL + 0.3 NLL = 0.2231436 + 0.3611918 = 0.5843354, bit for bit the sum of the terms,
    # whether or not a proximal target is given.
    pretraining = head_loss(Q_NEW, p, token, distill_weight=1.0, nll_weight=0.3)
    assert torch.equal(pretraining, kl + 0.3 * nll)
    assert torch.equal(head_loss(Q_NEW, p, token, distill_weight=1.0, nll_weight=0.3, proximal=q_old), pretraining)
    assert pretraining.item() == pytest.approx(0.5843354, abs=1e-6)
    # Slow path, 0.7 KL + 0.3 NLL + 0.1 proximal KL = 0.1562005 + 0.3611918 + 0.0121171 = 0.5295095.
    slow = head_loss(Q_NEW, p, token, distill_weight=0.7, nll_weight=0.3, proximal_weight=0.1, proximal=q_old)
    assert slow.item() == pytest.approx(0.5295095, abs=1e-6)
    with pytest.raises(ValueError, match="proximal target"):
        head_loss(Q_NEW, p, token, distill_weight=0.7, nll_weight=0.3, proximal_weight=0.1)


@pytest.fixture(scope="module")
def setup():
    """A tiny policy, path heads and a batch of its distillation targets."""
    model = build_tiny_model(init_std=0.5).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    seqs = [SampledSequence(tuple(torch.randint(2, 64, (20,), generator=g).tolist()), 4, i) for i in range(8)]
    targets = compute_targets(model, seqs, top_k=8, progress=False)
    embed = model.embed_tokens.weight.float()
    heads = HorizonHeads.for_model(model, "path", 3).float()
    batch = HeadBatch.from_targets(targets, torch.arange(len(targets)), heads.num_heads, embed)
    return model, heads, batch


def grads(heads: HorizonHeads) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in heads.parameters()]
    heads.zero_grad(set_to_none=True)
    return out


def own_proposal(heads: HorizonHeads, lm_head: torch.Tensor, batch: HeadBatch, m: int) -> SparseDistribution:
    with torch.no_grad():
        return sparse_distribution(F.linear(head_states(heads, batch), lm_head), m)


def test_proximal_term_is_zero_at_the_old_heads_and_off_at_weight_zero(setup):
    model, heads, batch = setup
    lm_head = model.lm_head.weight.float()
    pretraining = HeadTrainConfig().loss
    assert pretraining == HeadLossConfig(distill_weight=1.0, nll_weight=0.3, proximal_weight=0.0)
    loss = train_step(heads, lm_head, batch, pretraining)
    base = grads(heads)
    # q_old given but weighted 0: the same loss and gradients, bit for bit.
    with_old = replace(batch, proximal=own_proposal(heads, lm_head, batch, 8))
    assert train_step(heads, lm_head, with_old, pretraining) == loss
    assert all(torch.equal(a, b) for a, b in zip(base, grads(heads)))
    # q_old = the heads' own proposal: KL(q_old || q) is at its minimum, so neither loss nor gradient moves.
    proximal = HeadLossConfig(proximal_weight=0.5)
    assert train_step(heads, lm_head, with_old, proximal) == pytest.approx(loss, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(base, grads(heads)))
    with pytest.raises(ValueError, match="HeadBatch.proximal"):
        train_step(heads, lm_head, batch, proximal)


def test_proximal_term_alone_pulls_the_heads_to_q_old(setup):
    model, heads, batch = setup
    lm_head = model.lm_head.weight.float()
    target = HorizonHeads.for_model(model, "path", 3).float()
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    old = replace(batch, proximal=own_proposal(target, lm_head, batch, 8))
    heads = HorizonHeads.for_model(model, "path", 3).float()
    only_proximal = HeadLossConfig(distill_weight=0.0, nll_weight=0.0, proximal_weight=1.0)
    optimizer = torch.optim.Adam(heads.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        optimizer.zero_grad(set_to_none=True)
        losses.append(train_step(heads, lm_head, old, only_proximal))
        optimizer.step()
    assert losses[-1] < 0.1 * losses[0]


def test_loss_config_rejects_negative_weights():
    with pytest.raises(ValueError, match=r"^proximal_weight must be a finite number >= 0, got -0.1$"):
        HeadLossConfig(proximal_weight=-0.1)
    with pytest.raises(ValueError, match=r"^head_decay must be a finite number in \(0, 1\], got 0.0$"):
        HeadLossConfig(head_decay=0.0)
