"""A run's memory, per actor and per GPU, before anything starts; what to change when it does not fit.

`plan_memory(cfg, shape)` is a pure function of the config and the model's shape (see
`terms.py` for each count). Actors are placed on GPUs first-fit in the order Ray receives them
(learner ranks, rollout actors, the head-consolidation actor), so fractional GPUs share as the
cluster config means them to (`conf/cluster/gpu_node.yaml`: the consolidation actor on the first
rollout GPU). Where a GPU overflows, `fixing_override` tries the overrides that shrink the
largest term there and names the first that makes the whole run fit.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .architecture import ModelShape
from .terms import (
    DTYPE_BYTES,
    FP32,
    activations,
    cache_shape,
    decode_step,
    draft_heads,
    head_update,
    kv_cache,
    layer_backward,
    logits,
    model_states,
    prefill,
    zero_buffers,
)

GIB = 2**30
# Per GPU process: the CUDA context, cuBLAS / NCCL workspaces and the caching allocator's slack.
CUDA_RESERVE = 1.5 * GIB
LEARNER, ROLLOUT, CONSOLIDATION = "learner rank", "rollout actor", "head-consolidation actor"
WEIGHTS, GRADIENTS, OPTIMIZER = "weights", "gradients", "optimizer states"
ACTIVATIONS, REFERENCE, WEIGHT_SYNC = "activations", "reference model", "weight sync"
LOGITS, LAYER_BACKWARD = "logits + grad (fp32)", "one layer's backward"  # the backward's peak: whichever is larger
KV_CACHE, STEP, HEADS, POLICY_HEAD, HEAD_UPDATE = "KV cache", "step buffers", "draft heads", "policy LM head", "head update"
RESERVE, BUFFERS = "CUDA reserve", "DeepSpeed buckets"


@dataclass
class Term:
    name: str
    bytes: float
    note: str = ""


@dataclass
class ActorPlan:
    """One actor's memory on its device."""

    kind: str
    index: int
    gpus: float  # its Ray num_gpus; 0 = on the CPU
    terms: list[Term]

    @property
    def label(self) -> str:
        return self.kind if self.kind == CONSOLIDATION else f"{self.kind} {self.index}"

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


@dataclass
class GpuPlan:
    index: int
    actors: list[ActorPlan] = field(default_factory=list)

    @property
    def share(self) -> float:
        return sum(min(a.gpus, 1.0) for a in self.actors)

    @property
    def total(self) -> float:
        return sum(a.total for a in self.actors)


@dataclass
class MemoryPlan:
    actors: list[ActorPlan]
    gpus: list[GpuPlan]
    gpu_memory: float | None  # bytes per GPU (cluster.gpu_memory_gb); None: no check
    object_store: float  # bytes of one policy object in a node's object store (weight_sync=object_store), else 0

    @property
    def fits(self) -> bool:
        return self.gpu_memory is None or all(g.total <= self.gpu_memory for g in self.gpus)

    def fullest(self) -> GpuPlan | None:
        return max(self.gpus, key=lambda g: g.total, default=None)

    @property
    def margin(self) -> float | None:
        """Bytes left on the fullest GPU (negative: over)."""
        fullest = self.fullest()
        return None if self.gpu_memory is None or fullest is None else self.gpu_memory - fullest.total


def plan_memory(cfg, shape: ModelShape) -> MemoryPlan:
    """Every actor's memory terms for the `TrainConfig` `cfg` of a model of `shape`."""
    c = cfg.cluster
    actors = [ActorPlan(LEARNER, r, c.gpus_per_learner, learner_terms(cfg, shape, c.gpus_per_learner > 0))
              for r in range(c.learner_world_size)]
    rollout = rollout_terms(cfg, shape, c.gpus_per_rollout_actor > 0)
    actors += [ActorPlan(ROLLOUT, i, c.gpus_per_rollout_actor, list(rollout)) for i in range(c.num_rollout_actors)]
    if cfg.rollout.speculates:
        gpus = c.gpus_per_consolidation_actor
        actors.append(ActorPlan(CONSOLIDATION, 0, gpus, consolidation_terms(cfg, shape, gpus > 0)))
    gpu_memory = None if c.gpu_memory_gb is None else c.gpu_memory_gb * GIB
    # The object-store sync packs the policy in the replicas' dtype; the collective one uses no object.
    object_store = shape.params * DTYPE_BYTES[cfg.model.dtype] if cfg.cluster.weight_sync == "object_store" else 0
    return MemoryPlan(actors, place_on_gpus(actors), gpu_memory, object_store)


def place_on_gpus(actors: list[ActorPlan]) -> list[GpuPlan]:
    """First fit by GPU share: a whole-GPU actor takes GPUs of its own, fractions share one."""
    gpus: list[GpuPlan] = []
    for actor in actors:
        if actor.gpus <= 0:
            continue
        if actor.gpus >= 1:
            gpus.append(GpuPlan(len(gpus), [actor]))
            continue
        gpu = next((g for g in gpus if g.share + actor.gpus <= 1.0 + 1e-9), None)
        if gpu is None:
            gpu = GpuPlan(len(gpus))
            gpus.append(gpu)
        gpu.actors.append(actor)
    return gpus


def learner_terms(cfg, shape: ModelShape, on_gpu: bool) -> list[Term]:
    learner, world = cfg.learner, cfg.cluster.learner_world_size
    b = DTYPE_BYTES[learner.dtype]
    states = model_states(shape.params, shape.largest_module_params, learner.zero_stage, world, b)
    zero = f"ZeRO-{learner.zero_stage} over {world} rank{'s' * (world > 1)}"
    # A sequence longer than the budget runs alone; every padded position at most predicts a response token.
    tokens = max(learner.micro_batch_tokens, learner.max_seq_len)
    on = learner.activation_checkpointing
    other = activations(shape, tokens, b, not on)
    terms = [
        Term(WEIGHTS, states.weights, f"{shape.params / 1e9:.2f}B params in {learner.dtype}, {zero}"),
        Term(GRADIENTS, states.gradients, zero),
        Term(OPTIMIZER, states.optimizer, "AdamW moments" + (" + fp32 master" if b != FP32 else "")),
        Term(BUFFERS, zero_buffers(shape.params, learner.zero_stage, world, b), "gradient reduce (and prefetch) buckets"),
        Term(ACTIVATIONS, activations(shape, tokens, b, on),
             f"{tokens} tokens, checkpointing {'on' if on else 'off'} ({'off' if on else 'on'}: {other / GIB:.1f} GiB)"),
        backward_peak(shape, tokens, b, on),
    ]
    if learner.use_reference:
        terms.append(Term(REFERENCE, shape.params * b, "a whole frozen copy per rank"))
    terms += learner_sync_terms(cfg, shape, b)
    if on_gpu:
        terms.append(Term(RESERVE, CUDA_RESERVE, "CUDA context, NCCL, allocator slack"))
    return terms


def sync_bucket(cfg, shape: ModelShape, b: int) -> int:
    """Bytes of one weight-sync bucket of `b`-byte elements: a tensor larger than a bucket goes alone."""
    return max(int(cfg.cluster.weight_sync_bucket_mb * 2**20), shape.largest_module_params * b)


def learner_sync_terms(cfg, shape: ModelShape, b: int) -> list[Term]:
    """What a learner rank holds to send the policy: by collective, a bucket in the replicas' dtype
    (and under ZeRO-3 one bucket's parameters gathered); by the object store, ZeRO-3's whole policy."""
    world, zero3 = cfg.cluster.learner_world_size, cfg.learner.zero_stage == 3
    if cfg.cluster.weight_sync == "object_store":
        if not zero3:
            return []
        return [Term(WEIGHT_SYNC, shape.params * b * (1 - 1 / world), "object_store: ZeRO-3 gathers the whole policy")]
    sent = sync_bucket(cfg, shape, DTYPE_BYTES[cfg.model.dtype])
    gathered = sync_bucket(cfg, shape, b) if zero3 else 0
    note = "collective: one bucket to send" + (" and one bucket's parameters gathered (ZeRO-3)" if zero3 else "")
    return [Term(WEIGHT_SYNC, sent + gathered, note)]


def receiver_sync_terms(cfg, shape: ModelShape) -> list[Term]:
    """A rollout or consolidation actor's receive buffer under the collective sync (none by the object store,
    whose object lives in host memory)."""
    if cfg.cluster.weight_sync == "object_store":
        return []
    return [Term(WEIGHT_SYNC, sync_bucket(cfg, shape, DTYPE_BYTES[cfg.model.dtype]), "collective: one bucket received")]


def backward_peak(shape: ModelShape, tokens: int, b: int, checkpointing: bool, positions: int | None = None) -> Term:
    """The larger of the two moments a backward peaks at: the logits and their gradient at
    `positions` (default: every padded token predicts a response token, the most there can be),
    or later one layer's backward."""
    positions = tokens if positions is None else positions
    head, layer = logits(positions, shape.vocab, b), layer_backward(shape, tokens, b, checkpointing)
    if head >= layer:
        return Term(LOGITS, head, f"{positions} positions x {shape.vocab} vocab (later, one layer's backward: "
                                  f"{layer / GIB:.1f} GiB)")
    return Term(LAYER_BACKWARD, layer, f"{tokens} tokens (earlier, the logits: {head / GIB:.1f} GiB)")


def rollout_shape(cfg) -> tuple[int, int, int]:
    """(prompts per rollout actor, response rows its cache holds, tokens a decode step appends per row)."""
    prompts = -(-cfg.data.prompts_per_step // cfg.cluster.num_rollout_actors)
    rows = prompts * cfg.rollout.n
    if cfg.eval_every:
        rows = max(rows, cfg.eval.batch_size * max(cfg.eval.samples, 1))
    return prompts, rows, cfg.rollout.max_tokens_per_step


def rollout_terms(cfg, shape: ModelShape, on_gpu: bool) -> list[Term]:
    b = DTYPE_BYTES[cfg.model.dtype]
    prompts, rows, width = rollout_shape(cfg)
    # A prompt and its whole response fit learner.max_seq_len (preflight); a step appends up to `width` more.
    cache_rows, slots = cache_shape(rows, cfg.learner.max_seq_len + width)
    longest_prompt = cfg.learner.max_seq_len - cfg.rollout.max_new_tokens
    step = max(decode_step(shape, cache_rows, width, slots, b), prefill(shape, prompts, longest_prompt, slots, b))
    terms = [
        Term(WEIGHTS, shape.params * b, f"{shape.params / 1e9:.2f}B params in {cfg.model.dtype}"),
        Term(KV_CACHE, kv_cache(shape, cache_rows, slots, b), f"{cache_rows} rows x {slots} slots (tree slack {width})"),
        Term(STEP, step, f"prefill of {prompts} prompts or a step of {width} tokens per row"),
    ]
    if cfg.rollout.speculates:
        spec = cfg.rollout.speculation
        terms.append(Term(HEADS, draft_heads(shape, spec.num_heads, spec.head_type == "path", b), f"{spec.num_heads} heads"))
    terms += receiver_sync_terms(cfg, shape)
    if on_gpu:
        terms.append(Term(RESERVE, CUDA_RESERVE, "CUDA context, allocator slack"))
    return terms


def consolidation_terms(cfg, shape: ModelShape, on_gpu: bool) -> list[Term]:
    spec = cfg.rollout.speculation
    b = DTYPE_BYTES[cfg.learner.dtype]
    heads = draft_heads(shape, spec.num_heads, spec.head_type == "path", FP32)
    terms = [
        Term(POLICY_HEAD, shape.vocab * shape.hidden * b * (1 if shape.tied else 2), "LM head and embeddings"),
        Term(HEADS, 4 * heads, "float32 weights, gradients, AdamW moments"),
    ]
    if spec.uses_slow_path:
        records = spec.consolidation.batch_records
        terms.append(Term(HEAD_UPDATE, head_update(shape, spec.num_heads, records), f"{records} records per step"))
        terms += receiver_sync_terms(cfg, shape)  # the slow path's actor joins the weight-sync group
    if on_gpu:
        terms.append(Term(RESERVE, CUDA_RESERVE, "CUDA context, allocator slack"))
    return terms


# -- what to change ----------------------------------------------------------------------------

def with_override(cfg, path: str, value: Any):
    """`cfg` with the dotted field `path` set to `value`, every section re-validated (raises ValueError)."""
    head, _, rest = path.partition(".")
    return replace(cfg, **{head: with_override(getattr(cfg, head), rest, value) if rest else value})


def candidate_overrides(cfg, term: str) -> list[tuple[str, Any]]:
    """Overrides that shrink `term`, each alone, in the order worth trying."""
    learner, cluster = cfg.learner, cfg.cluster
    halvings = [learner.micro_batch_tokens // 2**k for k in range(1, 8)]
    micro = [("learner.micro_batch_tokens", t) for t in halvings if t >= max(learner.max_seq_len, 1)]
    checkpointing = [] if learner.activation_checkpointing else [("learner.activation_checkpointing", True)]
    stages = [("learner.zero_stage", s) for s in range(learner.zero_stage + 1, 4)]
    ranks = [("cluster.learner_world_size", n) for n in range(cluster.learner_world_size + 1, 65)]
    actors = [("cluster.num_rollout_actors", n) for n in range(cluster.num_rollout_actors + 1, 65)]
    sync = ([("cluster.weight_sync", "collective")] if cluster.weight_sync == "object_store" else
            [("cluster.weight_sync_bucket_mb", cluster.weight_sync_bucket_mb / 2**k) for k in range(1, 5)])
    records = [("rollout.speculation.consolidation.batch_records", cfg.rollout.speculation.consolidation.batch_records
                // 2**k) for k in range(1, 6)]
    by_term = {
        ACTIVATIONS: checkpointing + micro,
        LOGITS: micro,
        LAYER_BACKWARD: checkpointing + micro,
        WEIGHTS: stages + ranks,
        GRADIENTS: stages + ranks,
        BUFFERS: ranks,
        OPTIMIZER: stages + ranks,
        WEIGHT_SYNC: sync + ranks,
        KV_CACHE: actors,
        STEP: actors,
        HEAD_UPDATE: records,
    }
    return by_term.get(term, []) + checkpointing + micro + stages + ranks + actors


def fixing_override(cfg, shape: ModelShape, term: str) -> str | None:
    """The first `key=value` (from `candidate_overrides` of `term`) with which the run fits, or None."""
    for path, value in candidate_overrides(cfg, term):
        try:
            fixed = with_override(cfg, path, value)
        except ValueError:
            continue  # e.g. a world size that does not divide the prompts per step
        if plan_memory(fixed, shape).fits:
            return f"{path}={str(value).lower() if isinstance(value, bool) else value}"
    return None


def overflow(cfg, shape: ModelShape, plan: MemoryPlan) -> str:
    """Why the run does not fit, in one sentence: the GPU, its largest term and the override that fixes it."""
    gpu = plan.fullest()
    actor = max(gpu.actors, key=lambda a: a.total)
    term = actor.largest()
    fix = fixing_override(cfg, shape, term.name)
    how = f"set {fix}" if fix else "no single override makes it fit: change the model, cluster or batch sizes"
    return (f"the run needs {gpu.total / GIB:.1f} GiB on GPU {gpu.index} ({', '.join(a.label for a in gpu.actors)}), "
            f"cluster.gpu_memory_gb is {plan.gpu_memory / GIB:g}; the largest term is {actor.label}'s {term.name} "
            f"({term.bytes / GIB:.1f} GiB): {how} (python -m specroll.plan prints every term)")


def format_plan(plan: MemoryPlan) -> str:
    """Each kind of actor's terms (the first of each kind: the others are alike), then each GPU's total."""
    lines, seen = [], set()
    for actor in plan.actors:
        if actor.kind in seen:
            continue
        seen.add(actor.kind)
        where = f"{actor.gpus:g} GPU" if actor.gpus else "CPU"
        lines.append(f"{actor.label} ({where}):")
        lines += [f"  {t.name:<22}{t.bytes / GIB:9.2f} GiB  {t.note}" for t in actor.terms]
        lines.append(f"  {'total':<22}{actor.total / GIB:9.2f} GiB")
    for gpu in plan.gpus:
        names = ", ".join(a.label for a in gpu.actors)
        lines.append(f"GPU {gpu.index}: {gpu.total / GIB:7.2f} GiB  {names}")
    lines.append(f"object store: {plan.object_store / GIB:.2f} GiB per node (one policy object per weight sync)"
                 if plan.object_store else "object store: no policy object (cluster.weight_sync=collective)")
    if plan.gpu_memory is None:
        lines.append("cluster.gpu_memory_gb is null: no GPU to check against")
    else:
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(f"{verdict} on {plan.gpu_memory / GIB:g} GiB GPUs: margin {plan.margin / GIB:.1f} GiB "
                     f"on the fullest GPU" if plan.gpus else f"{verdict}: no actor on a GPU")
    return "\n".join(lines)
