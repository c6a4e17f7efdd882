"""Drift detector: when to run a head-only update of the draft heads (docs/algorithm.md, section 6).

Rule. The first `calibration_steps` optimizer steps set the baselines, then they are frozen:
per head k the pooled acceptance a0_k, and per head and depth bucket b the median m_kb and
robust scale s_kb = max(1.4826 * median|TV - m_kb|, mad_floor) of the per-step mean TV
between head and target. After calibration telemetry accumulates into a window, and every
`check_every` steps each head with at least `min_records` matured records in its window
(counted in buckets that have a baseline) is checked:

    z_k = sum_b n_kb (TV_kb - m_kb) / s_kb / sum_b n_kb

The head is degraded when z_k > z_threshold AND a0_k - a_k >= min_acceptance_drop (a_k its
acceptance over the window), outside cooldown. That is `signal="tv"`, the design's rule. The
default, `signal="acceptance"`, takes as z_k the fall in acceptance over its binomial standard
error instead (`acceptance_z`): on a measured drift the TV of head 0's records fell while its
acceptance fell by 0.07-0.18 (docs/history/2026-12-01.md), so the TV rule did not fire at its
threshold. A head degraded at `consecutive` consecutive checks triggers an event naming the
degraded heads with the largest z (at most `max_heads_per_event`), and starts a cooldown of
`cooldown_steps` steps.

Choices the design leaves open:
- Inside cooldown no head is degraded, so checks there reset every streak: the heads were
  just updated, and only telemetry of the new heads may build the next trigger.
- A head without enough records is not checked: its window keeps accumulating and its streak
  holds (a skipped check is evidence neither way). A checked head starts a new window.
- A bucket without calibration records has no baseline and is left out of z and of n.
  A head without calibration trials has no baseline acceptance and is never degraded.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

CONFIG_PATH = "rollout.speculation.drift"  # where DriftConfig sits in the run config; errors name it
MAD_SCALE = 1.4826  # MAD * 1.4826 estimates the standard deviation of normally distributed data
DRIFT_SIGNALS = ("tv", "acceptance")


@dataclass
class DriftConfig:
    calibration_steps: int = 20  # optimizer steps whose telemetry sets the baselines, then frozen
    check_every: int = 20  # steps between two checks after calibration
    min_records: int = 1024  # matured records a head needs in its window to be checked
    z_threshold: float = 2.5  # z (of `signal`) above which a head may be degraded
    min_acceptance_drop: float = 0.05  # baseline minus current acceptance a degraded head also needs
    consecutive: int = 2  # consecutive degraded checks of one head that trigger an update
    cooldown_steps: int = 50  # steps after a trigger with no trigger (the new heads settle in)
    max_heads_per_event: int = 2  # heads one update trains: the degraded ones with the largest z
    # Bucket edges on tokens generated so far: (128, 256) = buckets 0-128, 128-256, 256+.
    depth_buckets: tuple[int, ...] = (128, 256, 512, 1024)
    mad_floor: float = 0.01  # least TV scale: a bucket whose TV never varied must not divide by 0
    signal: str = "acceptance"  # the z a degraded head needs: of its acceptance drop, or robust z of TV (tv)

    def __post_init__(self) -> None:
        self.depth_buckets = tuple(self.depth_buckets)
        for name, least in (("calibration_steps", 1), ("check_every", 1), ("min_records", 1), ("consecutive", 1),
                            ("cooldown_steps", 0), ("max_heads_per_event", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{CONFIG_PATH}.{name} must be an int >= {least}, got {value!r}")
        if not self.z_threshold >= 0:
            raise ValueError(f"{CONFIG_PATH}.z_threshold must be >= 0, got {self.z_threshold}")
        if not 0 <= self.min_acceptance_drop <= 1:
            raise ValueError(f"{CONFIG_PATH}.min_acceptance_drop must be in [0, 1], got {self.min_acceptance_drop}")
        if self.signal not in DRIFT_SIGNALS:
            raise ValueError(f"{CONFIG_PATH}.signal must be one of {DRIFT_SIGNALS}, got {self.signal!r}")
        if not self.mad_floor > 0:
            raise ValueError(f"{CONFIG_PATH}.mad_floor must be > 0, got {self.mad_floor}")
        edges = self.depth_buckets
        if any(not isinstance(e, int) or e < 1 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"{CONFIG_PATH}.depth_buckets must be increasing positive ints, got {edges!r}")

    @property
    def num_buckets(self) -> int:
        return len(self.depth_buckets) + 1


def depth_bucket(tokens_so_far: torch.Tensor, edges: Sequence[int]) -> torch.Tensor:
    """Bucket index [N] of each record from the tokens its response had generated so far [N]."""
    bounds = torch.tensor(edges, dtype=torch.long, device=tokens_so_far.device)
    return torch.bucketize(tokens_so_far.long(), bounds, right=True)  # an edge starts the next bucket


# -- telemetry -------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)  # tensors: compare fields with torch.equal
class HeadTelemetry:
    """Per head k and depth bucket b: the matured records and verify outcomes of some steps.

    Counts add and means are count-weighted, so the telemetry of several rollout actors or
    several steps merges into one (`merge_telemetry`). A mean over no records is 0.
    """

    records: torch.Tensor  # [H, B] int64 matured records
    tv: torch.Tensor  # [H, B] float64 mean TV between head k's and the target's distribution
    nll: torch.Tensor  # [H, B] float64 mean cross-entropy -log q_k(realised token)
    gate: torch.Tensor  # [H, B] float64 mean Reflex gate activity
    accepted: torch.Tensor  # [H, B] int64 drafts of head k accepted by verification
    trials: torch.Tensor  # [H, B] int64 drafts of head k verified (their parent was reached)

    MEANS = ("tv", "nll", "gate")  # weighted by `records` when merged

    @classmethod
    def zeros(cls, num_heads: int, num_buckets: int) -> "HeadTelemetry":
        return cls(**{f.name: torch.zeros(num_heads, num_buckets, device="cpu",
                                          dtype=torch.float64 if f.name in cls.MEANS else torch.long)
                      for f in fields(cls)})

    @classmethod
    def from_records(cls, num_heads: int, num_buckets: int, head: torch.Tensor, bucket: torch.Tensor,
                     tv: torch.Tensor, nll: torch.Tensor, gate: torch.Tensor) -> "HeadTelemetry":
        """From matured records: head [N], bucket [N], and per record tv, nll, gate [N]."""
        shape, cells = (num_heads, num_buckets), num_heads * num_buckets
        cell = (head.long() * num_buckets + bucket.long()).cpu()  # flat [H * B] index
        n = torch.bincount(cell, minlength=cells)
        means = {name: (torch.bincount(cell, weights=x.double().cpu(), minlength=cells) / n.clamp(min=1)).view(shape)
                 for name, x in (("tv", tv), ("nll", nll), ("gate", gate))}
        return replace(cls.zeros(*shape), records=n.view(shape), **means)

    @classmethod
    def from_trials(cls, num_heads: int, num_buckets: int, head: torch.Tensor, bucket: torch.Tensor,
                    accepted: torch.Tensor) -> "HeadTelemetry":
        """From verified drafts: head [N], bucket [N], accepted [N] bool."""
        shape, cells = (num_heads, num_buckets), num_heads * num_buckets
        cell = (head.long() * num_buckets + bucket.long()).cpu()
        trials = torch.bincount(cell, minlength=cells)
        hits = torch.bincount(cell, weights=accepted.double().cpu(), minlength=cells).round().long()
        return replace(cls.zeros(*shape), accepted=hits.view(shape), trials=trials.view(shape))

    def acceptance(self) -> torch.Tensor:
        """[H] accepted share of head k's verified drafts, pooled over buckets; nan without trials."""
        return self.accepted.sum(1).double() / self.trials.sum(1).double()

    def cpu(self) -> "HeadTelemetry":
        return HeadTelemetry(**{f.name: getattr(self, f.name).cpu() for f in fields(self)})

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name).clone() for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> "HeadTelemetry":
        return cls(**{f.name: state[f.name] for f in fields(cls)}).cpu()


def merge_telemetry(parts: Sequence[HeadTelemetry]) -> HeadTelemetry:
    """One telemetry from several (actors or steps): counts summed, means count-weighted."""
    if not parts:
        raise ValueError("merge_telemetry needs at least one telemetry")
    records = sum(p.records for p in parts)
    merged = {name: sum(getattr(p, name) * p.records for p in parts) / records.clamp(min=1)
              for name in HeadTelemetry.MEANS}
    return HeadTelemetry(records=records, accepted=sum(p.accepted for p in parts),
                         trials=sum(p.trials for p in parts), **merged)


def clear_heads(telemetry: HeadTelemetry, heads: torch.Tensor) -> HeadTelemetry:
    """`telemetry` with the rows of `heads` [H] bool zeroed (those heads start a new window)."""
    return HeadTelemetry(**{f.name: getattr(telemetry, f.name).masked_fill(heads[:, None], 0)
                            for f in fields(telemetry)})


# -- the rule, as pure functions --------------------------------------------------------------

def robust_baseline(tv_samples: torch.Tensor, mad_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Median and robust scale [H, B] of per-step mean TVs tv_samples [S, H, B] (nan: no records).

    scale = max(MAD_SCALE * median|TV - median|, mad_floor); nan for a bucket without samples.
    """
    median = tv_samples.double().nanquantile(0.5, dim=0)
    mad = (tv_samples.double() - median).abs().nanquantile(0.5, dim=0)
    return median, (MAD_SCALE * mad).clamp(min=mad_floor)


def robust_z(tv: torch.Tensor, records: torch.Tensor, median: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """z [H] = sum_b n_b (tv_b - median_b) / scale_b / sum_b n_b over buckets with a baseline;
    tv, records, median, scale [H, B]; nan for a head without records in such buckets."""
    n = baseline_records(records, median).double()
    deviation = ((tv.double() - median) / scale).masked_fill(median.isnan(), 0.0)
    return (n * deviation).sum(1) / n.sum(1)


def acceptance_z(base_accepted: torch.Tensor, base_trials: torch.Tensor, accepted: torch.Tensor,
                 trials: torch.Tensor) -> torch.Tensor:
    """z [H] of the fall in acceptance from the baseline (base_*) to the window: (a0 - a) over
    sqrt(p (1 - p) (1/n0 + 1/n)), p the pooled rate (a two-proportion test); nan without trials.
    Drafts of one response are not independent, so this z runs high: the acceptance margin and
    consecutive checks guard against that."""
    base_accepted, base_trials, accepted, trials = (x.double() for x in (base_accepted, base_trials, accepted, trials))
    pooled = (base_accepted + accepted) / (base_trials + trials)
    se = (pooled * (1 - pooled) * (1 / base_trials + 1 / trials)).sqrt().clamp(min=1e-12)
    return (base_accepted / base_trials - accepted / trials) / se


def baseline_records(records: torch.Tensor, median: torch.Tensor) -> torch.Tensor:
    """records [H, B] in buckets that have a baseline (the n of `robust_z`), 0 elsewhere."""
    return records.masked_fill(median.isnan(), 0)


def top_heads(z: torch.Tensor, degraded: torch.Tensor, k: int) -> list[int]:
    """Up to k degraded heads (degraded [H] bool), largest z [H] first; ties by head index."""
    order = sorted((i for i in range(z.shape[0]) if degraded[i]), key=lambda i: (-float(z[i]), i))
    return order[:k]


# -- the detector -------------------------------------------------------------------------------

@dataclass(frozen=True)
class DriftEvent:
    """Run a head-only update of these heads (0-based indices), most degraded first."""

    step: int
    heads: tuple[int, ...]
    z: tuple[float, ...]  # their robust z at the triggering check


@dataclass(frozen=True, eq=False)
class DriftCheck:
    """The outcome of one check (what `heads/drift_*` metrics report)."""

    step: int
    z: torch.Tensor  # [H] z (of the configured signal) of each checked head; nan: not checked
    acceptance_drop: torch.Tensor  # [H] baseline minus window acceptance; nan: not checked or unknown
    degraded: torch.Tensor  # [H] bool
    streak: torch.Tensor  # [H] consecutive degraded checks after this one (0 after a trigger)
    in_cooldown: bool
    event: DriftEvent | None

    @property
    def z_max(self) -> float:
        """Largest z of a checked head; nan when no head had enough records."""
        finite = self.z[~self.z.isnan()]
        return float(finite.max()) if finite.numel() else math.nan


class DriftDetector:
    """Feed it one merged `HeadTelemetry` per optimizer step, in order; it says when to update.

    All state is explicit attributes (tensors and ints), saved by `state_dict` so that a
    resumed run keeps its baselines, window, streaks and cooldown.
    """

    def __init__(self, cfg: DriftConfig, num_heads: int) -> None:
        self.cfg, self.num_heads = cfg, num_heads
        shape = (num_heads, cfg.num_buckets)
        self.step = 0  # steps observed
        self.triggers = 0  # events since the start of the run
        self.cooldown_until = 0  # no trigger at steps <= this
        # Small tensors, kept on the CPU like the telemetry that feeds them.
        self.streak = torch.zeros(num_heads, dtype=torch.long, device="cpu")
        self.calibration_tv = torch.full((cfg.calibration_steps, *shape), math.nan, dtype=torch.float64, device="cpu")
        self.calibration = HeadTelemetry.zeros(*shape)  # pooled over calibration steps (acceptance)
        self.tv_median = torch.full(shape, math.nan, dtype=torch.float64, device="cpu")
        self.tv_scale = torch.full(shape, math.nan, dtype=torch.float64, device="cpu")
        self.baseline_acceptance = torch.full((num_heads,), math.nan, dtype=torch.float64, device="cpu")
        self.window = HeadTelemetry.zeros(*shape)  # since each head's last check

    @property
    def calibrated(self) -> bool:
        return self.step >= self.cfg.calibration_steps

    def observe(self, telemetry: HeadTelemetry) -> DriftCheck | None:
        """Take one step's telemetry; the check's outcome on a check step, else None."""
        found, expected = tuple(telemetry.records.shape), (self.num_heads, self.cfg.num_buckets)
        if found != expected:
            raise ValueError(f"telemetry has shape {found}, expected [heads, buckets] {expected}")
        telemetry = telemetry.cpu()
        self.step += 1
        if self.step <= self.cfg.calibration_steps:
            self.calibrate(telemetry)
            return None
        self.window = merge_telemetry([self.window, telemetry])
        if (self.step - self.cfg.calibration_steps) % self.cfg.check_every:
            return None
        return self.check()

    def calibrate(self, telemetry: HeadTelemetry) -> None:
        self.calibration_tv[self.step - 1] = telemetry.tv.double().masked_fill(telemetry.records == 0, math.nan)
        self.calibration = merge_telemetry([self.calibration, telemetry])
        if self.step == self.cfg.calibration_steps:
            self.tv_median, self.tv_scale = robust_baseline(self.calibration_tv, self.cfg.mad_floor)
            self.baseline_acceptance = self.calibration.acceptance()

    def check(self) -> DriftCheck:
        cfg, w = self.cfg, self.window
        checked = baseline_records(w.records, self.tv_median).sum(1) >= cfg.min_records
        if cfg.signal == "tv":
            z = robust_z(w.tv, w.records, self.tv_median, self.tv_scale)
        else:
            base = self.calibration
            z = acceptance_z(base.accepted.sum(1), base.trials.sum(1), w.accepted.sum(1), w.trials.sum(1))
        z = z.masked_fill(~checked, math.nan)
        drop = (self.baseline_acceptance - w.acceptance()).masked_fill(~checked, math.nan)
        in_cooldown = self.step <= self.cooldown_until
        # nan compares false: an unchecked head or one without an acceptance baseline is not degraded.
        degraded = (z > cfg.z_threshold) & (drop >= cfg.min_acceptance_drop)
        if in_cooldown:
            degraded = torch.zeros_like(degraded)
        self.streak = torch.where(checked, torch.where(degraded, self.streak + 1, 0), self.streak)
        event = None
        if bool((self.streak >= cfg.consecutive).any()):
            heads = top_heads(z, degraded, cfg.max_heads_per_event)
            event = DriftEvent(self.step, tuple(heads), tuple(float(z[h]) for h in heads))
            self.triggers += 1
            self.cooldown_until = self.step + cfg.cooldown_steps
            self.streak = torch.zeros_like(self.streak)
        self.window = clear_heads(w, checked)
        return DriftCheck(self.step, z, drop, degraded, self.streak.clone(), in_cooldown, event)

    # -- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain tensors and numbers: loadable with torch.load(weights_only=True)."""
        return {
            "num_heads": self.num_heads, "num_buckets": self.cfg.num_buckets,
            "step": self.step, "triggers": self.triggers, "cooldown_until": self.cooldown_until,
            "streak": self.streak.clone(), "calibration_tv": self.calibration_tv.clone(),
            "calibration": self.calibration.state_dict(), "tv_median": self.tv_median.clone(),
            "tv_scale": self.tv_scale.clone(), "baseline_acceptance": self.baseline_acceptance.clone(),
            "window": self.window.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        found = (state["num_heads"], state["num_buckets"], state["calibration_tv"].shape[0])
        wanted = (self.num_heads, self.cfg.num_buckets, self.cfg.calibration_steps)
        if found != wanted:
            raise ValueError(f"drift state has (heads, buckets, calibration steps) {found}, this detector {wanted}")
        self.step, self.triggers = int(state["step"]), int(state["triggers"])
        self.cooldown_until = int(state["cooldown_until"])
        self.streak, self.calibration_tv = state["streak"].cpu(), state["calibration_tv"].cpu()
        self.tv_median, self.tv_scale = state["tv_median"].cpu(), state["tv_scale"].cpu()
        self.baseline_acceptance = state["baseline_acceptance"].cpu()
        self.calibration = HeadTelemetry.from_state_dict(state["calibration"])
        self.window = HeadTelemetry.from_state_dict(state["window"])
