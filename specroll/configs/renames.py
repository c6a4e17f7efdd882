"""Config keys and values renamed since earlier runs, so an old override is named with its new spelling."""
from __future__ import annotations

# Override text before -> after (docs/guide.md, Changelog).
RENAMED = {
    "rollout.spec.": "rollout.speculation.",  # 2026-12-06
    "rollout=specroll": "rollout=speculation",
    "rollout.mode=specroll": "rollout.mode=speculation",
}


def renamed_overrides(overrides: list[str]) -> list[str]:
    """One line per override that uses a renamed key or value: 'old -> new'."""
    lines = []
    for override in overrides:
        for old, new in RENAMED.items():
            bare = override.lstrip("+~")
            if bare.startswith(old) and (old.endswith(".") or bare == old):
                lines.append(f"{override} -> {override.replace(old, new, 1)}")
    return lines
