"""The decoder a rollout config asks for (`rollout.mode` vanilla, speculation or fastgrpo).

The one factory of decoders sits here, above the packages it draws on: speculation/ and
fastgrpo/ import rollout/, and configs/ imports speculation/ and fastgrpo/, so in rollout/ or
configs/ it would close an import circle.
"""
from __future__ import annotations

from .configs.sections import RolloutConfig
from .fastgrpo.decoder import FastGRPODecoder
from .rollout.decoder import Decoder
from .rollout.plain_decoder import PlainDecoder
from .speculation.decoder import SpeculativeDecoder


def build_decoder(model, rollout: RolloutConfig) -> Decoder:
    """`rollout.mode`'s decoder of `model`, compiled where `rollout.compile` says."""
    if rollout.mode == "speculation":
        return SpeculativeDecoder(model, rollout.speculation, compile=rollout.compile)
    if rollout.mode == "fastgrpo":
        return FastGRPODecoder(model, rollout.fastgrpo, compile=rollout.compile)
    return PlainDecoder(model, compile=rollout.compile)
