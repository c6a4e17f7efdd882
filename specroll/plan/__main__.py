"""`python -m specroll.plan <the overrides of python -m specroll.train>`: the run's memory, term by
term, and whether it fits `cluster.gpu_memory_gb` (exit status 1 when it does not)."""
from __future__ import annotations

import sys

from specroll.command_line import compose_train_config, errors_as_messages, refuse_renamed

from . import format_plan, model_shape, overflow, plan_memory


def main(overrides: list[str]) -> int:
    refuse_renamed(overrides)
    with errors_as_messages("invalid config"):
        cfg = compose_train_config(overrides)
        shape = model_shape(cfg.model)
    plan = plan_memory(cfg, shape)
    print(f"{cfg.model.name}: {shape.params / 1e9:.2f}B parameters, {shape.layers} layers, "
          f"hidden {shape.hidden}, vocabulary {shape.vocab}")
    print(format_plan(plan))
    if not plan.fits:
        print(f"does not fit: {overflow(cfg, shape, plan)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
