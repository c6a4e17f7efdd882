"""The policy's own samples that the head-training and drafter-pretraining commands read: their
flags, and the prompts and cached samples those flags name (both commands share one cache)."""
from __future__ import annotations

import argparse
import time
from typing import NamedTuple

from specroll.speculation.head_training.samples import SampleCollection, SampleConfig, collect_samples, dataset_prompts

from .flags import add_config_arguments


def add_sample_flags(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """`--samples-cache`, `--heldout-every` and a flag per `SampleConfig` field (`defaults`
    replaces the fields' own) but its seed, the command's `--seed`, and its temperature."""
    parser.add_argument("--samples-cache", default=None,
                        help="folder of sample caches (default ~/.cache/specroll/head_samples)")
    parser.add_argument("--heldout-every", type=int, default=20, help="every n-th prompt is held out for evaluation")
    # At the policy's own temperature: the heads learn what it samples.
    add_config_arguments(parser, SampleConfig, exclude=("temperature", "seed"), defaults=defaults)


def dataset_names(datasets: str) -> list[str]:
    """`--dataset gsm8k,synthetic` as a list of names."""
    return [n.strip() for n in datasets.split(",") if n.strip()]


class PolicySamples(NamedTuple):
    prompts: list[list[int]]
    samples: SampleCollection
    config: SampleConfig
    seconds: float  # spent sampling (0-ish when the cache held them)


def samples_from_args(model, tokenizer, args: argparse.Namespace) -> PolicySamples:
    """The prompts and the policy's samples (cached) that a command's flags name: --dataset,
    --data-path, --samples-cache and the `SampleConfig` parsed from its flags (`args.sample_config`)."""
    prompts = dataset_prompts(tokenizer, dataset_names(args.dataset), args.data_path)
    sample_cfg = args.sample_config
    started = time.perf_counter()
    samples = collect_samples(model, prompts, sample_cfg, args.samples_cache)
    seconds = time.perf_counter() - started
    print(f"{len(samples.sequences)} sequences from {samples.path} ({samples.new_batches} batches generated "
          f"in {seconds:.0f}s)")
    return PolicySamples(prompts, samples, sample_cfg, seconds)
