"""The GRPO learner: the policy wrapped in DeepSpeed, updated from rollout samples.

Gradient accumulation. DeepSpeed divides each backward by `gradient_accumulation_steps`
and assumes a fixed number of micro-batches per step, but token-budgeted micro-batches vary
in number. So DeepSpeed is configured with `gradient_accumulation_steps=1`, every backward
passes `scale_wrt_gas=False`, and the learner marks the last micro-batch of each mini-batch
with `set_gradient_accumulation_boundary(True)` before calling `engine.step()` once. Each
micro-batch loss is divided by the mini-batch-wide normaliser, so the accumulated gradient
is exactly the full mini-batch gradient. Across data-parallel ranks the normaliser is summed
and the loss multiplied by the world size, because DeepSpeed averages gradients over ranks.
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import torch

from specroll.grpo import aggregate, policy_loss, soft_overlong_penalty, valid_token_mask
from specroll.models import CausalLM, resolve_device
from specroll.telemetry import metric_names as m

from .batching import GRPOSamples, MicroBatch, loss_normalizer, micro_batch_indices, mini_batch_indices, pad_samples
from .collectives import ensure_distributed, max_over_ranks, sum_over_ranks, world_size
from .config import LearnerConfig
from .logprobs import sequence_logprobs
from .phases import phase


def lr_multiplier(step: int, cfg: LearnerConfig) -> float:
    """Factor on `cfg.lr` for the optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_ds_config(cfg: LearnerConfig) -> dict:
    """The DeepSpeed config dict; see the module docstring for the accumulation settings."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "betas": list(cfg.betas),
                "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay,
                "torch_adam": True,
                # One kernel per tensor (CPU and CUDA) instead of a dozen elementwise passes.
                "fused": True,
            },
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def training_dtype(cfg: LearnerConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32


def build_engine(model: CausalLM, cfg: LearnerConfig):
    """`model` in `cfg.dtype` inside a DeepSpeed engine: AdamW, clipping, ZeRO stage and the
    `lr_multiplier` schedule of `cfg`, after joining the process group (`ensure_distributed`)."""
    import deepspeed

    ensure_distributed(resolve_device(cfg.device), cfg.collective_timeout_s)
    model.use_activation_checkpointing(cfg.activation_checkpointing)
    engine, *_ = deepspeed.initialize(
        model=model.to(dtype=training_dtype(cfg)),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=build_ds_config(cfg),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, cfg)
        ),
    )
    if world_size() == 1 and cfg.zero_stage == 0:
        # One rank has nothing to reduce; DeepSpeed would still flatten and copy back every gradient.
        engine.enable_backward_allreduce = False
    return engine


class MetricSums:
    """Sums behind the train/* metrics of one `update`, reduced over ranks at the end."""

    # Per-token means: the loss's key for each, and the metric it becomes.
    PER_TOKEN = {"clip_frac_low": m.CLIP_FRAC_LOW, "clip_frac_high": m.CLIP_FRAC_HIGH,
                 "dual_clip_frac": m.DUAL_CLIP_FRAC, "approx_kl": m.APPROX_KL, "kl_ref": m.KL_REF,
                 "entropy": m.ENTROPY, "cispo_clip_frac": m.CISPO_CLIP_FRAC, "is_weight_mean": m.IS_WEIGHT_MEAN,
                 "is_clipped_frac": m.IS_CLIPPED_FRAC, "entropy_mask_frac": m.ENTROPY_MASK_FRAC}
    # A fixed key list: every rank must all-reduce the same vector.
    KEYS = tuple(k for key in PER_TOKEN for k in (key, f"{key}/tokens")) + (
        "loss", "pg_loss", "lr", "grad_norm", "optimizer_steps", "skipped_steps", "real_tokens", "padded_tokens",
    )

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.KEYS, 0.0)

    def add(self, key: str, value: float) -> None:
        self.sums[key] += float(value)

    def add_micro_batch(self, metrics: dict[str, torch.Tensor], entropy: torch.Tensor, tokens: int) -> None:
        for key in self.PER_TOKEN:
            value = entropy if key == "entropy" else metrics.get(key)
            if value is not None:
                self.add(key, float(value) * tokens)
                self.add(f"{key}/tokens", tokens)
        self.add("loss", metrics["loss"])
        self.add("pg_loss", metrics["pg_loss"])

    def reduced(self) -> dict[str, float]:
        return dict(zip(self.KEYS, sum_over_ranks([self.sums[k] for k in self.KEYS])))


class GRPOLearner:
    """Holds the policy in a DeepSpeed engine; `update` runs GRPO on one rollout batch.

    With several ranks every method is collective: each rank calls it with its own shard of
    the samples (the same number of samples on every rank).
    """

    def __init__(self, model: CausalLM, cfg: LearnerConfig) -> None:
        """`model` is the initial policy; with `cfg.use_reference` a frozen copy of it becomes
        the reference, so a learner resumed from a checkpoint still compares to the start."""
        cfg.validate()
        self.cfg = cfg
        self.model_config = model.config
        # Copied before DeepSpeed touches the model: ZeRO-3 partitions weights in place.
        reference = copy.deepcopy(model) if cfg.use_reference else None
        self.engine = build_engine(model, cfg)
        self.device = self.engine.device  # this rank's device, e.g. cuda:<local rank>
        self.reference = None
        if reference is not None:
            self.reference = reference.to(device=self.device, dtype=training_dtype(cfg)).eval().requires_grad_(False)
        self.version = 0

    @property
    def module(self) -> CausalLM:
        return self.engine.module

    def apply_optimizer_settings(self) -> None:
        """`cfg`'s learning rate, betas, epsilon and weight decay in the optimizer, over those a loaded
        checkpoint restored: its schedule position is kept, the rate it scales is the config's."""
        cfg, scheduler = self.cfg, self.engine.lr_scheduler
        scheduler.base_lrs = [cfg.lr for _ in scheduler.base_lrs]
        for group in self.engine.optimizer.param_groups:
            group.update(lr=cfg.lr * lr_multiplier(scheduler.last_epoch, cfg), initial_lr=cfg.lr,
                         betas=tuple(cfg.betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        scheduler._last_lr = [group["lr"] for group in self.engine.optimizer.param_groups]

    def build_samples(
        self,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        rewards,
        group_size: int,
        truncated=None,
        old_logprobs: list[torch.Tensor] | None = None,
        sampler_logprobs: list[list[float]] | None = None,
    ) -> GRPOSamples:
        """`GRPOSamples.from_rollouts` with this learner's advantage and invalid-reward settings,
        the soft overlong penalty added to the rewards where it is on. `sampler_logprobs` (the
        rollout's, per response) are kept only where the loss corrects the mismatch."""
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
        if self.cfg.overlong_max_len is not None:
            lengths = torch.tensor([len(r) for r in response_ids])
            rewards = rewards + soft_overlong_penalty(lengths, self.cfg.overlong_max_len, self.cfg.overlong_buffer_len)
        if self.cfg.loss.mismatch_correction is None:
            sampler_logprobs = None
        elif sampler_logprobs is None:
            raise ValueError("loss.mismatch_correction needs the rollout's sampler_logprobs")
        return GRPOSamples.from_rollouts(
            prompt_ids,
            response_ids,
            rewards,
            group_size,
            truncated=truncated,
            old_logprobs=old_logprobs,
            scale_by_std=self.cfg.scale_advantages_by_std,
            on_invalid=self.cfg.on_invalid_reward,
            sampler_logprobs=sampler_logprobs,
        )

    def check_samples(self, samples: GRPOSamples) -> None:
        samples.validate(self.cfg.max_response_len, self.cfg.max_seq_len, self.model_config.vocab_size)

    def micro_batches(self, samples: GRPOSamples, indices: list[int], old=None, ref=None) -> list[MicroBatch]:
        groups = micro_batch_indices(samples.sequence_lengths(), indices, self.cfg.micro_batch_tokens)
        return [pad_samples(samples, g, old, ref).to(self.device) for g in groups]

    @torch.no_grad()
    def compute_logprobs(self, samples: GRPOSamples, use_reference: bool = False) -> list[torch.Tensor]:
        """Per-response log-probs [len_i] (float32, CPU) under the current policy, or the reference."""
        self.check_samples(samples)
        if use_reference and self.reference is None:
            raise ValueError("no reference model: construct the learner with use_reference=True")
        model = self.reference if use_reference else self.engine
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        batches = self.micro_batches(samples, list(range(len(samples))))
        # ZeRO-3 gathers weights inside each forward: every rank runs as many as the busiest.
        num_forwards = len(batches) if use_reference else int(max_over_ranks([len(batches)])[0])
        for k in range(num_forwards):
            mb = batches[min(k, len(batches) - 1)]
            logprobs = sequence_logprobs(model, mb.input_ids, mb.prompt_lens, mb.response_lens, self.cfg.temperature)
            if k >= len(batches):
                continue
            for row, (index, length) in enumerate(zip(mb.indices.tolist(), mb.response_lens.tolist())):
                out[index] = logprobs.logprobs[row, :length].cpu()
        return out

    def old_logprobs_from_update(self, num_samples: int) -> bool:
        """Whether `update` takes missing old log-probs from its own forward instead of a separate pass.

        With one epoch of one mini-batch that forward runs under the policy that `compute_logprobs`
        would score with, so its detached log-probs are the old ones: the ratio is exactly 1 and the
        loss and step are those of the two-pass update, for one forward less.
        """
        one_mini_batch = self.cfg.mini_batch_size is None or self.cfg.mini_batch_size >= num_samples
        return self.cfg.ppo_epochs == 1 and one_mini_batch

    def update(self, samples: GRPOSamples) -> dict[str, float]:
        """`ppo_epochs` passes of shuffled mini-batches, one optimizer step each; train/* metrics.

        Without `samples.old_logprobs` the old log-probs are the current policy's: from the
        update's own forward where `old_logprobs_from_update`, else from `compute_logprobs` first.
        """
        self.check_samples(samples)
        if self.cfg.loss.mismatch_correction is not None and samples.sampler_logprobs is None:
            raise ValueError("loss.mismatch_correction needs samples.sampler_logprobs, the rollout's log-probs")
        if world_size() > 1:
            most, fewest = max_over_ranks([len(samples), -len(samples)])
            if most != -fewest:
                raise ValueError(f"every rank must pass the same number of samples, got {-fewest:.0f} to {most:.0f}")
        old = samples.old_logprobs
        if old is None and not self.old_logprobs_from_update(len(samples)):
            old = self.compute_logprobs(samples)
        ref = self.compute_logprobs(samples, use_reference=True) if self.reference is not None else None
        sums = MetricSums()
        start_version = self.version
        for epoch in range(self.cfg.ppo_epochs):
            # Derived from the step, not drawn from a running generator: a resumed run shuffles alike.
            generator = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + start_version) * 1009 + epoch)
            for indices in mini_batch_indices(len(samples), self.cfg.mini_batch_size, generator):
                self.optimizer_step(self.micro_batches(samples, indices, old, ref), sums)
        return self.finish_metrics(sums, samples)

    def optimizer_step(self, batches: list[MicroBatch], sums: MetricSums) -> None:
        loss_cfg = self.cfg.loss
        normalizer = sum_over_ranks([loss_normalizer(batches, loss_cfg)])[0]
        num_micro = int(max_over_ranks([len(batches)])[0])
        sums.add("real_tokens", sum(int((mb.prompt_lens + mb.response_lens).sum()) for mb in batches))
        sums.add("padded_tokens", sum(mb.num_padded_tokens for mb in batches))
        if normalizer == 0:
            # Every token is masked (e.g. all responses truncated): no signal, so no step.
            sums.add("skipped_steps", 1)
            return
        for k in range(num_micro):
            # A rank with fewer micro-batches repeats its last one with zero weight, so every
            # rank runs the same forward/backward collectives (ZeRO-2/3).
            mb, weight = (batches[k], 1.0) if k < len(batches) else (batches[-1], 0.0)
            self.engine.set_gradient_accumulation_boundary(k == num_micro - 1)
            out = sequence_logprobs(
                self.engine, mb.input_ids, mb.prompt_lens, mb.response_lens, self.cfg.temperature, with_entropy=True
            )
            # No old log-probs here means this forward is the sampling policy's (`old_logprobs_from_update`).
            old = out.logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs
            with phase("loss"):
                loss, metrics = policy_loss(
                    out.logprobs,
                    old,
                    mb.advantages,
                    out.mask,
                    loss_cfg,
                    logp_ref=mb.ref_logprobs,
                    truncated=mb.truncated,
                    normalizer=normalizer,
                    logp_sampler=mb.sampler_logprobs,
                    entropy=out.entropy,
                )
            with phase("backward"):
                self.engine.backward(loss * (weight * world_size()), scale_wrt_gas=False)
            if weight:
                valid = valid_token_mask(out.mask, mb.truncated, loss_cfg.mask_truncated)
                sums.add_micro_batch(metrics, aggregate(out.entropy, valid, "token-mean"), int(valid.sum()))
        with phase("optimizer_step"):
            grad_norm = self.unreported_grad_norm()
            sums.add("lr", self.engine.get_lr()[0])
            self.engine.step()
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        sums.add("grad_norm", float(grad_norm))
        sums.add("optimizer_steps", 1)
        self.version += 1

    def unreported_grad_norm(self) -> float | None:
        """DeepSpeed's plain-optimizer path (ZeRO-0, float32) clips without recording the norm."""
        if hasattr(self.engine.optimizer, "_global_grad_norm"):
            return None
        norms = [torch.linalg.vector_norm(p.grad.float()) for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def finish_metrics(self, sums: MetricSums, samples: GRPOSamples) -> dict[str, float]:
        zero_std = samples.zero_std_groups
        num_seq, response_tokens, num_truncated, num_skipped, zero_std_groups, groups = sum_over_ranks([
            len(samples),
            sum(len(r) for r in samples.response_ids),
            float(samples.truncated_flags().sum()),
            samples.num_skipped,
            0.0 if zero_std is None else float(zero_std.sum()),
            0.0 if zero_std is None else zero_std.numel(),
        ])
        total = sums.reduced()
        world = world_size()
        steps = total["optimizer_steps"] / world
        metrics: dict[str, float] = {}
        for key, name in MetricSums.PER_TOKEN.items():
            if total[f"{key}/tokens"]:
                metrics[name] = total[key] / total[f"{key}/tokens"]
        if steps:
            # loss / pg_loss are each rank's share of its step's loss, so they sum over ranks.
            metrics[m.LOSS] = total["loss"] / steps
            metrics[m.PG_LOSS] = total["pg_loss"] / steps
            metrics[m.GRAD_NORM] = total["grad_norm"] / (steps * world)
            metrics[m.LR] = total["lr"] / (steps * world)
        metrics.update({
            m.OPTIMIZER_STEPS: steps,
            m.SKIPPED_STEPS: total["skipped_steps"] / world,
            m.POLICY_VERSION: float(self.version),
            m.NUM_SEQUENCES: num_seq,
            m.RESPONSE_TOKENS: response_tokens,
            m.RESPONSE_LEN_MEAN: response_tokens / num_seq,
            m.TRUNCATED_FRAC: num_truncated / num_seq,
            m.SKIPPED_INVALID_REWARD: num_skipped,
            m.PADDING_FRAC: 1.0 - total["real_tokens"] / total["padded_tokens"],
        })
        if groups:
            metrics[m.FRAC_ZERO_STD_GROUPS] = zero_std_groups / groups
        if self.cfg.overlong_max_len is not None:
            lengths = torch.tensor([len(r) for r in samples.response_ids])
            penalty = soft_overlong_penalty(lengths, self.cfg.overlong_max_len, self.cfg.overlong_buffer_len)
            metrics[m.OVERLONG_PENALTY_MEAN] = sum_over_ranks([float(penalty.sum())])[0] / num_seq
        return metrics

    @contextlib.contextmanager
    def gathered_state(self, names: list[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The policy's state dict on this rank's device, in our parameter names, while the context
        lasts: whole for `names` (all when None). ZeRO-3 gathers those partitioned weights
        collectively (every rank enters, with the same `names`); the others stay empty there."""
        import deepspeed

        module = self.engine.module
        if names is None:
            params = list(module.parameters())
        else:
            state = module.state_dict(keep_vars=True)
            params = [state[name] for name in names if isinstance(state[name], torch.nn.Parameter)]
        gathered = (
            deepspeed.zero.GatheredParameters(params)
            if self.cfg.zero_stage == 3
            else contextlib.nullcontext()
        )
        with gathered:
            yield module.state_dict()

    def policy_state_dict(self) -> tuple[int, dict[str, torch.Tensor]]:
        """`(version, full weights on CPU)` in our parameter names, gathered from any ZeRO stage.

        Tied tensors stay shared. `version` counts optimizer updates; rollout workers use it
        to know which policy sampled a response.
        """
        out: dict[str, torch.Tensor] = {}
        with self.gathered_state() as state:
            copies: dict[int, torch.Tensor] = {}
            for name, tensor in state.items():
                key = tensor.data_ptr()
                if key not in copies:
                    copies[key] = tensor.detach().to("cpu", copy=True)
                out[name] = copies[key]
        return self.version, out
