"""Command-line tools, each `python -m specroll.tools.<name>`: parse flags, call the library, save.

- `sft`: supervised warm start of the policy (`specroll.learner.sft_trainer`).
- `train_heads`: horizon heads by self-distillation (`specroll.speculation.head_training`).
- `pretrain_drafter`: the FastGRPO-style drafter (`specroll.fastgrpo.pretrain`).
- `profile`: verify latency over a grid and C_hw (`specroll.speculation.budgets.hardware_profile`).

Their shared flags are defined once, in `flags`; the library never imports this package.
"""
