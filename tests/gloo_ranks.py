"""Two ranks in spawned processes joined by gloo, for tests of what data-parallel learners share."""

import os

import torch
import torch.distributed
import torch.multiprocessing as mp


def run_two_ranks(run_rank, out_dir: str) -> None:
    """Runs `run_rank(rank, out_dir)` in two processes joined by one gloo group; raises if either fails."""
    mp.start_processes(rank_main, args=(run_rank, out_dir), nprocs=2, start_method="spawn")


def rank_main(rank: int, run_rank, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    # A rendezvous file, not a port: a free port picked by the parent can be taken by another
    # process before rank 0, seconds of imports later, listens on it.
    torch.distributed.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    run_rank(rank, out_dir)
    torch.distributed.barrier()
    # Both ranks are done and their files closed. Tearing gloo down at interpreter exit can abort a
    # rank (SIGABRT, "terminate called without an active exception", seen in CI), so exit at once.
    os._exit(0)
