"""Export a run's trained policy as a directory `transformers` loads, with its draft heads beside it.

    python -m specroll.tools.export runs/quickstart exported/quickstart-policy
    python -m specroll.tools.export runs/quickstart/checkpoints/step_00000020 out/policy --dtype bfloat16

SOURCE is a run_dir (its newest intact checkpoint) or a checkpoint folder. OUT_DIR gets
config.json, generation_config.json, model.safetensors and the tokenizer files (with its chat
template); the checkpoint's draft heads go to OUT_DIR.heads.safetensors, where `model.name=OUT_DIR`
with `rollout.speculation.heads_path=shipped` finds them. `AutoModelForCausalLM.from_pretrained(OUT_DIR)`
greedy-decodes the same tokens as our engine.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import torch

from specroll.command_line import errors_as_messages
from specroll.configs import ModelSection
from specroll.eval.policy import CheckpointPolicy, find_checkpoint, read_checkpoint_policy
from specroll.learner import export_hf
from specroll.models import resolve_checkpoint, resolve_dtype
from specroll.models.loading import DTYPES
from specroll.speculation import HorizonHeads
from specroll.speculation.drafting.heads import heads_beside

COMMAND = "python -m specroll.tools.export"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a run_dir (its newest intact checkpoint) or a checkpoint folder")
    p.add_argument("out_dir", help="the new directory (must not exist, or be empty)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="dtype of the exported weights (default: the checkpoint's)")
    return p.parse_args(argv)


def model_tokenizer(section: ModelSection):
    """The tokenizer of the run's model (of `model.tokenizer` for a tiny model); None when it has none."""
    from transformers import AutoTokenizer

    name = section.tokenizer if section.tiny_type is not None else section.name
    return None if name is None else AutoTokenizer.from_pretrained(resolve_checkpoint(name))


def export_policy(policy: CheckpointPolicy, out_dir: str | Path, dtype: str | None = None) -> tuple[Path, Path | None]:
    """The checkpoint's policy as a transformers directory, and its heads beside it (None without heads)."""
    weights = policy.weights
    if dtype is not None:
        weights = {k: v.to(resolve_dtype(dtype)) if v.is_floating_point() else v for k, v in weights.items()}
    out = export_hf(weights, policy.model_config, model_tokenizer(policy.model_section), out_dir)
    saved = policy.heads
    if saved is None or saved.meta is None:
        return out, None
    heads = HorizonHeads.from_state(asdict(saved.meta), saved.state)
    heads.version = saved.version  # the meta's may predate the checkpoint's last head update
    heads.base_model_name = str(out)  # drafts for the exported policy from here on
    heads_file = heads_beside(out)
    heads.save(heads_file, dtype=torch.float32)
    return out, heads_file


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with errors_as_messages("error"):
        checkpoint = find_checkpoint(args.source)
        if checkpoint is None:
            raise ValueError(f"{args.source} is neither a run_dir with checkpoints nor a complete checkpoint folder")
        try:
            out, heads = export_policy(read_checkpoint_policy(checkpoint), args.out_dir, args.dtype)
        except FileExistsError as exc:
            raise ValueError(str(exc)) from None
    print(f"exported {checkpoint} to {out}")
    print(f"  heads: {heads}" if heads else "  heads: none in the checkpoint (rollout=vanilla?)")


if __name__ == "__main__":
    main()
