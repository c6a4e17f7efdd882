"""The decoder a rollout config asks for (`rollout.mode` vanilla, speculation or fastgrpo), and
what the rollout actor asks of it beyond its steps (`RolloutDecoder`).

The one factory of decoders sits here, above the packages it draws on: speculation/ and
fastgrpo/ import rollout/, and configs/ imports speculation/ and fastgrpo/, so in rollout/ or
configs/ it would close an import circle. It is the one place that tells the modes apart:
the rollout actor, the driver and evaluation ask the decoder (`RolloutDecoder`) or this module.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from .configs.sections import RolloutSection
from .fastgrpo.decoder import FastGRPODecoder
from .fastgrpo.online import DrafterUpdate
from .rollout.decoder import Decoder, DecoderCheckpoint
from .rollout.plain_decoder import PlainDecoder
from .speculation import SpeculationConfig
from .speculation.adaptation.head_records import HeadRecords
from .speculation.decoder import SpeculativeDecoder
from .speculation.drafting.heads_state import HeadsState
from .speculation.drafting.suffix_drafts import merged_history


class RolloutDecoder(Decoder, Protocol):
    """What the rollout actor asks of a decoder beyond the engine's steps: its horizon heads, what
    it learns from a training call's responses, and what a run checkpoint keeps of it."""

    @property
    def heads_version(self) -> int | None:
        """The version of the horizon heads it drafts with; None: it drafts with none."""

    def heads_state(self) -> HeadsState | None:
        """Its horizon heads, copied to the CPU (the consolidation actor's reference); None without."""

    def load_heads(self, heads: HeadsState) -> int:
        """Draft with `heads` from the next generate call on, unless they are older than its own;
        the version it then holds. Raises where it drafts with no horizon heads."""

    def learn_from_responses(self, prompts: list[list[int]], responses: list[list[int]], group_size: int) -> None:
        """Learn from the training generate call that just ended: its `responses` (prompt-major,
        `group_size` per prompt) to `prompts`. Evaluation calls teach nothing."""

    def pop_head_records(self) -> HeadRecords | None:
        """The slow path's telemetry and records of the generate calls since the last pop; None without a slow path."""

    def pop_drafter_update(self) -> DrafterUpdate | None:
        """The online drafter update `learn_from_responses` made; None without one."""

    def checkpoint_state(self) -> DecoderCheckpoint:
        """What a run checkpoint keeps of it, on the CPU."""

    def load_checkpoint_state(self, state: DecoderCheckpoint) -> None:
        """Resume from `checkpoint_state()`'s output; the parts it does not keep are passed over."""


# (policy, rollout config, seed of what it learns, a checkpoint's heads or None) -> the decoder
DecoderBuilder = Callable[[object, RolloutSection, int, HeadsState | None], RolloutDecoder]


def plain(model, rollout: RolloutSection, seed: int, heads: HeadsState | None) -> PlainDecoder:
    return PlainDecoder(model, compile=rollout.compile)


def speculative(model, rollout: RolloutSection, seed: int, heads: HeadsState | None) -> SpeculativeDecoder:
    spec = rollout.speculation
    if heads is not None:  # a checkpoint's heads replace the configured ones: none are looked for
        spec = replace(spec, heads_path=None)
    decoder = SpeculativeDecoder(model, spec, compile=rollout.compile)
    if heads is not None:
        decoder.load_heads(heads)
    return decoder


def fastgrpo(model, rollout: RolloutSection, seed: int, heads: HeadsState | None) -> FastGRPODecoder:
    return FastGRPODecoder(model, rollout.fastgrpo, compile=rollout.compile, seed=seed)


DECODERS: dict[str, DecoderBuilder] = {"vanilla": plain, "speculation": speculative, "fastgrpo": fastgrpo}


def build_decoder(model, rollout: RolloutSection, seed: int = 0, heads: HeadsState | None = None) -> RolloutDecoder:
    """`rollout.mode`'s decoder of `model`, compiled where `rollout.compile` says; `seed` seeds what it
    learns online, `heads` (a checkpoint's) replace the configured horizon heads where it has any."""
    return DECODERS[rollout.mode](model, rollout, seed, heads)


def heads_config(rollout: RolloutSection) -> SpeculationConfig | None:
    """The settings of the horizon heads `rollout`'s decoder drafts with, which the head-consolidation
    actor keeps and adapts; None: it drafts with none (no consolidation actor)."""
    return rollout.speculation if rollout.mode == "speculation" else None


def resumed_checkpoints(drafter: list | None, draft_history: list | None, actors: int) -> list[DecoderCheckpoint] | None:
    """What each of `actors` rollout actors resumes from a checkpoint's per-actor parts; None where it holds none.
    Each actor resumes its own; with another actor count, every actor takes actor 0's drafter and
    every actor's history (prompts move between actors; each one's bounds keep the newest)."""
    if drafter is None and draft_history is None:
        return None
    merged = None if draft_history is None or len(draft_history) == actors else merged_history(draft_history)

    def own(i: int) -> DecoderCheckpoint:
        return DecoderCheckpoint(drafter=None if drafter is None else drafter[i if len(drafter) == actors else 0],
                                 draft_history=draft_history[i] if draft_history is not None and merged is None else merged)

    return [own(i) for i in range(actors)]
