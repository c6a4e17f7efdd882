"""The memory planner: every term of a run's GPU memory, per actor and per GPU, before it starts.

    python -m specroll.plan experiment=paper_gsm8k_qwen2_5_1_5b
    python -m specroll.plan experiment=paper_gsm8k_qwen2_5_1_5b cluster.gpu_memory_gb=40

Preflight runs it (`check_fits`), so a run that cannot fit fails before the cluster starts.
"""
from .architecture import ModelShape, model_shape, shipped_architecture
from .planner import GIB, MemoryPlan, format_plan, overflow, plan_memory


def check_fits(cfg) -> str | None:
    """None when `cfg`'s run fits `cluster.gpu_memory_gb` (or that is null), else why not and what fixes it."""
    if cfg.cluster.gpu_memory_gb is None:
        return None
    shape = model_shape(cfg.model)
    plan = plan_memory(cfg, shape)
    return None if plan.fits else overflow(cfg, shape, plan)


__all__ = ["GIB", "MemoryPlan", "ModelShape", "check_fits", "format_plan", "model_shape", "overflow", "plan_memory",
           "shipped_architecture"]
