"""Pretraining of the FastGRPO-style drafter on the policy's own samples (the heads' samples cache).

The frozen policy's samples come from `speculation.head_training.samples` (the same cache file
as `python -m specroll.tools.train_heads` with the same sampling settings); one teacher-forced
pass gives the features, and the drafter trains with the online loss (`fastgrpo.loss`) for a
few epochs. Its quality is measured as tokens per verify pass of the FastGRPO decoder on
held-out prompts, at a fixed tree size, before and after training. The command is
`python -m specroll.tools.pretrain_drafter`.
"""
from __future__ import annotations

from specroll.speculation.head_training.samples import SampledSequence

from ..rollout import RolloutEngine, SamplingParams
from .config import FastGRPOConfig, OnlineConfig
from .decoder import FastGRPODecoder
from .drafter import FeatureDrafter
from .feature_log import DraftSequences, teacher_forced_sequences
from .online import OnlineDrafterLearner


def sample_features(model, sequences: list[SampledSequence], batch_tokens: int = 8192) -> DraftSequences:
    return teacher_forced_sequences(model, [list(s.ids[: s.prompt_len]) for s in sequences],
                                    [list(s.ids[s.prompt_len :]) for s in sequences], batch_tokens)


def pretrain_drafter(model, drafter: FeatureDrafter, train: DraftSequences, epochs: int, cfg: OnlineConfig,
                     heldout: DraftSequences | None = None, log=print) -> dict:
    """Train `drafter` in place for `epochs` passes over `train`; returns losses per epoch (held-out
    losses too, epoch 0 = before training). The drafter's online update count stays 0."""
    learner = OnlineDrafterLearner(drafter, model, cfg)
    heldout_loss = [learner.loss(heldout)] if heldout is not None else []
    train_loss = []
    for epoch in range(1, epochs + 1):
        update = learner.update(train)
        train_loss.append(update.loss)
        if heldout is not None:
            heldout_loss.append(learner.loss(heldout))
        log(f"epoch {epoch}: train loss {update.loss:.4f}" + (f", held-out {heldout_loss[-1]:.4f}" if heldout else "")
            + f" ({update.seconds:.0f}s)")
    learner.master.updates = 0
    learner.publish()
    return {"train_loss": train_loss, "heldout_loss": heldout_loss}


def tokens_per_pass(model, drafter: FeatureDrafter, prompts: list[list[int]], nodes: int, n: int,
                    max_new_tokens: int, seed: int = 0) -> dict:
    """The FastGRPO decoder's tokens per verify pass and acceptance by depth on `prompts`, N = `nodes` fixed."""
    cfg = FastGRPOConfig(drafter_path=None, capacity=nodes * len(prompts) * n, max_nodes=nodes,
                         online=OnlineConfig(enabled=False))
    engine = RolloutEngine(model, decoder=FastGRPODecoder(model, cfg))
    engine.decoder.set_drafter(drafter)
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, n=n, seed=seed))
    return {"nodes": nodes, "tokens_per_pass": out.stats.tree.tokens_per_step_mean,
            "acceptance_by_depth": out.stats.tree.acceptance_by_depth, "responses": len(out.token_ids),
            "tokens": out.stats.tokens}
