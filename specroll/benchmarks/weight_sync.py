"""Weight sync from the learner to a rollout replica, by either path: where the seconds and the bytes go.

    python -m specroll.benchmarks.weight_sync --model smollm2 [--dtype bfloat16] [--repeats 3] [--json out.json]

On a local Ray cluster:
  stages      each stage of an object-store sync run alone in this process (torch threads as an
              actor has them): the learner's gather (`LearnerActor.policy_weights`), `ray.put`,
              `ray.get` (deserialisation from the shared-memory store), the replica's load
              (`RolloutActor.load_policy`) and the repacking of its prepacked linears, which the
              first forward after a sync pays;
  actors      the object store's publish and load as remote calls between real actors, and
              `RunActors.sync_policy` (both together): what `timing_s/weight_sync` reports;
  paths       `RunActors.sync_policy` by each `cluster.weight_sync` side by side: its seconds, the
              bytes it moves (object_store: the one object put in the store, which a replica on the
              same node maps without a copy; collective: what learner rank 0 writes to its sockets,
              one copy per replica), each actor's peak host memory during a sync above what it
              held before (VmHWM, reset before each sync; the object store's shared memory counts
              where an actor touches it) and its resident memory after the last.
Each time is the median over `--repeats`, each peak the largest.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import ray
import torch

from ..actors import LearnerActor, RolloutActor, RunActors
from ..command_line import compose_train_config
from ..configs import TrainConfig
from .process_memory import proc_figure, reset_peak

# The model's config group and the lengths that fit its context (nothing is generated here).
MODELS = {"tiny": ["model=tiny", "rollout.max_new_tokens=16", "learner.max_response_len=16", "learner.max_seq_len=256"],
          "smollm2": ["model=smollm2_135m"]}
STAGES = ("gather", "put", "get", "load", "repack")
PATHS = ("object_store", "collective")  # cluster.weight_sync


def benchmark_config(model: str, dtype: str, path: str = "object_store") -> TrainConfig:
    """Vanilla rollouts (no head-consolidation actor), `dtype` replicas, a float32 learner, no
    logging, weights by `path`."""
    overrides = [*MODELS[model], f"model.dtype={dtype}", "model.device=cpu", "learner.device=cpu",
                 "rollout=vanilla", "logger=none", "resume=never", "checkpoint_every=0",
                 f"cluster.weight_sync={path}"]
    return compose_train_config(overrides)


def seconds(run: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def one_token_forward(replica: RolloutActor) -> Callable[[], object]:
    ids = torch.zeros(1, 1, dtype=torch.long)
    return lambda: replica.model(ids)


@torch.no_grad()
def stage_seconds(cfg: TrainConfig, repeats: int) -> tuple[dict[str, float], int]:
    """Median seconds of each stage of a sync, run one after another in this process, and the
    number of parameters shipped."""
    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_learner)))
    learner = LearnerActor(cfg, rank=0, world_size=1)
    learner.setup(*learner.master_address())
    replica = RolloutActor(cfg, index=0)
    forward = one_token_forward(replica)
    forward()  # the replica's linears are packed once, as in a rollout actor that has generated
    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    for _ in range(repeats):
        gather_s, (version, weights) = seconds(learner.policy_weights)
        put_s, ref = seconds(lambda: ray.put(weights))
        del weights
        get_s, received = seconds(lambda: ray.get(ref))
        load_s, _ = seconds(lambda: replica.load_policy(version, received))
        first_s, _ = seconds(forward)
        steady_s, _ = seconds(forward)
        del received, ref
        for stage, value in zip(STAGES, (gather_s, put_s, get_s, load_s, max(0.0, first_s - steady_s))):
            times[stage].append(value)
    params = sum(p.numel() for p in replica.model.parameters())
    return {stage: statistics.median(values) for stage, values in times.items()}, params


def actor_seconds(actors: RunActors, repeats: int) -> dict[str, float]:
    """Median seconds of an object-store sync between real actors (learner to one rollout actor):
    `publish` (the learner's `policy_weights` until its version arrives: gather, pack, store),
    `load` (the rollout actor's `load_policy`: fetch and copy in) and `sync_policy`, the two through `RunActors`."""
    learner, replica = actors.learners[0], actors.rollout[0]
    times: dict[str, list[float]] = {"publish": [], "load": [], "sync_policy": []}
    for _ in range(repeats):
        version, weights = learner.policy_weights.options(num_returns=2).remote()
        publish_s, version = seconds(lambda: ray.get(version))
        load_s, _ = seconds(lambda: ray.get(replica.load_policy.remote(version, weights)))
        del weights
        actors.rollout_version = None  # the replica is told it is behind, so the call ships the weights
        sync_s, _ = seconds(actors.sync_policy)
        for name, value in zip(times, (publish_s, load_s, sync_s)):
            times[name].append(value)
    return {name: statistics.median(values) for name, values in times.items()}


def path_figures(actors: RunActors, repeats: int) -> dict:
    """`sync_policy` by the actors' `cluster.weight_sync`: median seconds, the bytes it moves, the
    learner's and the replica's peak host memory above what each held before a sync (the largest,
    the first sync's included), and what each holds after the last."""
    pids = {kind: ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
            for kind, actor in (("learner", actors.learners[0]), ("rollout", actors.rollout[0]))}
    times, peaks, moved = [], dict.fromkeys(pids, 0), 0
    for _ in range(repeats):
        held = {}
        for kind, pid in pids.items():
            reset_peak(pid)
            held[kind] = proc_figure(pid, "status", "VmRSS")
        written = proc_figure(pids["learner"], "io", "wchar")
        actors.rollout_version = None  # the replica is told it is behind, so the call ships the weights
        sync_s, _ = seconds(actors.sync_policy)
        times.append(sync_s)
        for kind, pid in pids.items():
            peaks[kind] = max(peaks[kind], proc_figure(pid, "status", "VmHWM") - held[kind])
        if actors.cfg.cluster.weight_sync == "collective":
            moved = proc_figure(pids["learner"], "io", "wchar") - written
        else:
            moved = ray.get(actors.learners[0].__ray_call__.remote(lambda a: a.packed.nbytes))
    held_after = {kind: proc_figure(pid, "status", "VmRSS") for kind, pid in pids.items()}
    return {"sync_policy_s": statistics.median(times), "moved_bytes": moved, "peak_rss_bytes": peaks,
            "rss_after_bytes": held_after}


def between_actors(model: str, dtype: str, repeats: int) -> tuple[dict[str, float], dict[str, dict]]:
    """`actor_seconds` of the object store, and `path_figures` of each path, each path on actors of its own."""
    paths = {}
    for path in PATHS:
        actors = RunActors.start(benchmark_config(model, dtype, path))
        try:
            paths[path] = path_figures(actors, repeats)  # first: a path's first sync allocates its buffers
            if path == "object_store":
                breakdown = actor_seconds(actors, repeats)
        finally:
            actors.shutdown()
    return breakdown, paths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="the policy to ship")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the replica's dtype")
    parser.add_argument("--repeats", type=int, default=3, help="syncs per measurement; medians are reported")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    cfg = benchmark_config(args.model, args.dtype)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False)  # its own, even beside a run's cluster
    try:
        stages, params = stage_seconds(cfg, args.repeats)
        actor_breakdown, paths = between_actors(args.model, args.dtype, args.repeats)
    finally:
        if started_ray:
            ray.shutdown()
    result = {"model": args.model, "dtype": args.dtype, "parameters": params, "repeats": args.repeats,
              "stages_s": stages, "stages_total_s": sum(stages.values()), "actors_s": actor_breakdown, "paths": paths}
    print(f"weight sync of {args.model} ({params / 1e6:.1f}M parameters) to a {args.dtype} replica, "
          f"median of {args.repeats}:")
    for stage, value in stages.items():
        print(f"  {stage:<8} {value:8.3f} s")
    print(f"  {'total':<8} {result['stages_total_s']:8.3f} s   (object store, stages one by one, in this process)")
    print("object store between actors: " + ", ".join(f"{name} {value:.3f} s" for name, value in actor_breakdown.items()))
    print(f"  {'cluster.weight_sync':<20} {'sync_policy':>11} {'bytes moved':>12} {'learner peak':>13} "
          f"{'replica peak':>13} {'learner after':>14} {'replica after':>14}")
    for path, figures in paths.items():
        peak, after = figures["peak_rss_bytes"], figures["rss_after_bytes"]
        print(f"  {path:<20} {figures['sync_policy_s']:9.3f} s {figures['moved_bytes'] / 2**20:8.1f} MiB "
              f"{peak['learner'] / 2**20:+9.1f} MiB {peak['rollout'] / 2**20:+9.1f} MiB "
              f"{after['learner'] / 2**20:10.1f} MiB {after['rollout'] / 2**20:10.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
