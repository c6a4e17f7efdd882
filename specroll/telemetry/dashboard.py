"""The SpecRoll W&B workspace: one section per question a run raises, every chart against the training step.

    python -m specroll.telemetry.dashboard --entity ENTITY --project specroll

saves it as a new view of the W&B project that runs with `logger=wandb_online` log to (or that
`wandb sync` uploaded offline runs to) and prints its URL; this needs the network and a W&B API
key (`wandb login` or $WANDB_API_KEY). `SECTIONS` and `build_workspace` are pure: the workspace
is defined, and tested, offline.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from . import metric_names as m

ACCEPTANCE_DEPTHS = range(1, 6)  # the shipped heads draft 4 deep, FastGRPO-style trees up to 5


@dataclass(frozen=True)
class Chart:
    """One line chart: `metrics` against `train/step`, stacked areas when `stacked`."""

    title: str
    metrics: tuple[str, ...]
    stacked: bool = False


SECTIONS: dict[str, tuple[Chart, ...]] = {
    "Throughput": (
        Chart("generated tokens/s", (m.GEN_TOKENS_PER_S,)),
        Chart("trained tokens/s", (m.TRAIN_TOKENS_PER_S,)),
        Chart("step and generation seconds", (m.STEP_TIME_S, m.TIME_GEN)),
    ),
    "Step-time breakdown": (
        Chart("where the step's time goes (s)", m.family_names("timing_s"), stacked=True),
        Chart("head updates: seconds and driver wait", (m.HEADS_UPDATE_S, m.HEADS_UPDATE_WAIT_S)),
        Chart("share of speculative time: drafting, Reflex", (m.DRAFT_TIME_FRAC, m.REFLEX_TIME_FRAC)),
    ),
    "Speculation": (
        Chart("tokens per verify pass (1 = no gain)", (m.TOKENS_PER_STEP,)),
        Chart("acceptance by tree depth", tuple(m.acceptance_depth(d) for d in ACCEPTANCE_DEPTHS)),
        Chart("node budget and active rows", (m.NODE_BUDGET_MEAN, m.ACTIVE_ROWS_MEAN)),
        Chart("verify passes", (m.VERIFY_STEPS,)),
        Chart("tokens per verify pass where a tree was drafted", (m.DRAFTED_TOKENS_PER_STEP,)),
        Chart("context lookup's share of accepted drafts", (m.LOOKUP_TOKEN_SHARE,)),
    ),
    "Adaptation": (
        Chart("head versions: drafting, published", (m.HEAD_VERSION, m.HEADS_VERSION)),
        Chart("head updates and drift triggers", (m.HEADS_UPDATES, m.HEADS_DRIFT_TRIGGERS)),
        Chart("drift: largest robust TV z", (m.HEADS_DRIFT_Z_MAX,)),
        Chart("head update loss", (m.HEADS_LOSS,)),
        Chart("replay memory", (m.HEADS_REPLAY_RECORDS, m.HEADS_REPLAY_DROPPED)),
        Chart("Reflex: on share, reliability", (m.REFLEX_ON_FRAC, m.REFLEX_RELIABILITY)),
        Chart("Reflex: records, resets, guard trips", (m.REFLEX_RECORDS, m.REFLEX_RESETS, m.REFLEX_GUARD_TRIPS)),
        Chart("FastGRPO-style drafter: online updates, loss", (m.DRAFTER_UPDATES, m.DRAFTER_LOSS)),
    ),
    "Learning": (
        Chart("reward and accuracy", (m.REWARD_MEAN, m.ACCURACY)),
        Chart("loss", (m.LOSS, m.PG_LOSS)),
        Chart("KL", (m.APPROX_KL, m.KL_REF)),
        Chart("entropy", (m.ENTROPY,)),
        Chart("gradient norm", (m.GRAD_NORM,)),
        Chart("clipped token shares", (m.CLIP_FRAC_LOW, m.CLIP_FRAC_HIGH, m.DUAL_CLIP_FRAC)),
        Chart("groups without signal", (m.FRAC_ZERO_STD_GROUPS,)),
        Chart("response length and clip ratio", (m.RESPONSE_LENGTH_MEAN, m.CLIP_RATIO)),
        Chart("loss variants: token shares capped (CISPO), mismatch-clipped, entropy-selected",
              (m.CISPO_CLIP_FRAC, m.IS_CLIPPED_FRAC, m.ENTROPY_MASK_FRAC)),
        Chart("mismatch weight mean and overlong penalty", (m.IS_WEIGHT_MEAN, m.OVERLONG_PENALTY_MEAN)),
        Chart("dynamic sampling: groups kept, dropped, resampled", (m.KEPT_GROUPS, m.DROPPED_GROUPS, m.RESAMPLED_GROUPS)),
        Chart("dynamic sampling: extra rounds, skipped updates", (m.RESAMPLE_ROUNDS, m.STEP_SKIPPED)),
    ),
}


def build_workspace(entity: str, project: str, name: str = "SpecRoll"):
    """The workspace object of `SECTIONS` (a `wandb_workspaces.workspaces.Workspace`), built offline."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    sections = [
        ws.Section(
            name=title,
            is_open=True,
            panels=[wr.LinePlot(title=c.title, x=m.STEP, y=list(c.metrics), plot_type="stacked-area" if c.stacked else None)
                    for c in charts],
        )
        for title, charts in SECTIONS.items()
    ]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        settings=ws.WorkspaceSettings(x_axis=m.STEP))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entity", required=True, help="W&B team or user owning the project")
    ap.add_argument("--project", default="specroll", help="W&B project the runs log to (logger.project)")
    ap.add_argument("--name", default="SpecRoll", help="name of the saved workspace view")
    args = ap.parse_args(argv)
    import wandb

    try:
        workspace = build_workspace(args.entity, args.project, args.name).save()
    except wandb.errors.UsageError as exc:  # no API key: say so without a traceback
        raise SystemExit(f"error: {exc} (or set WANDB_API_KEY)") from None
    print(f"SpecRoll workspace saved: {workspace.url}")
    return workspace.url


if __name__ == "__main__":
    main()
