"""Two learner ranks (separate processes, gloo) each hash the checkpoint files they wrote: rank 0
never reads rank 1's, yet the COMPLETE marker records every file with its right hash, and damage
to a file of rank 1 is found and named."""

import json
import os
import sys
from pathlib import Path

import pytest
from gloo_ranks import run_two_ranks
from specroll.learner import CheckpointDamagedError, verify_checkpoint
from specroll.learner.checkpoint import CompletionMarker, file_hash

ZERO_STAGES = (2, 3)


def run_rank(rank: int, out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from specroll.learner import checkpoint, save_checkpoint
    from test_learner_checkpoint import make_learner, random_samples

    hashed: list[str] = []
    hash_one = checkpoint.file_hash

    def noting(path):
        hashed.append(str(path))
        return hash_one(path)

    checkpoint.file_hash = noting  # which files this rank reads to hash them
    for zero_stage in ZERO_STAGES:
        learner = make_learner(zero_stage)
        learner.update(random_samples(4, seed=rank))
        save_checkpoint(learner, os.path.join(out_dir, f"ckpt{zero_stage}"), step=1)
        Path(out_dir, f"hashed{zero_stage}_rank{rank}.json").write_text(json.dumps(hashed))
        hashed.clear()


def test_each_rank_hashes_its_own_files_and_the_marker_covers_every_one(tmp_path):
    run_two_ranks(run_rank, str(tmp_path))
    for zero_stage in ZERO_STAGES:
        checkpoint = tmp_path / f"ckpt{zero_stage}" / "step_00000001"
        hashed = [{Path(p).relative_to(checkpoint.with_name(checkpoint.name + ".tmp")).as_posix()
                   for p in json.loads((tmp_path / f"hashed{zero_stage}_rank{rank}.json").read_text())}
                  for rank in range(2)]
        rank1_files = {"rng_rank1.pt", "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"}
        if zero_stage == 3:
            rank1_files.add("deepspeed/zero_pp_rank_1_mp_rank_00_model_states.pt")
        assert hashed[1] == rank1_files
        assert not hashed[0] & hashed[1]
        assert {"policy.safetensors", "rng_rank0.pt", "state.json"} <= hashed[0]

        marker = CompletionMarker.read(checkpoint)
        on_disk = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
        assert set(marker.files) == on_disk - {"COMPLETE"} == hashed[0] | hashed[1]
        for name, record in marker.files.items():
            assert record.sha256 == file_hash(checkpoint / name), name
        verify_checkpoint(checkpoint)

        damaged = checkpoint / "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 0xFF
        damaged.write_bytes(bytes(data))
        with pytest.raises(CheckpointDamagedError, match=f"{damaged.name} has another sha256"):
            verify_checkpoint(checkpoint)
