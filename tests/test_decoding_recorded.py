"""Decoding against values recorded before the speculation package was restructured.

Tiny Llama and Qwen2 models generate across node budgets (fixed, concurrency, cost model),
adaptation modes (static, both), sampling settings (T = 1, T = 0.7 with top-p 0.9, greedy) and
the FastGRPO decoder. Tokens and log-probabilities, and every statistic that does not depend on
timing, must equal what `tests/data/decoding_recorded.json` holds: a restructure that changes
what is drafted, accepted or counted fails here. The cost model plans from measured timings, so
only its responses are compared (they are plain sampling's whatever was drafted).

    python tests/test_decoding_recorded.py --record   # rewrite the recorded values (a deliberate change)
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from specroll.fastgrpo import FastGRPOConfig, FastGRPODecoder
from specroll.fastgrpo.drafter import FeatureDrafter
from specroll.models import build_tiny_model
from specroll.rollout import GenerationStats, RolloutEngine, SamplingParams
from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder

RECORDED = Path(__file__).parent / "data" / "decoding_recorded.json"
PROMPTS = [[3, 5, 2, 9], [2, 6], [4, 4, 7, 3, 0, 5, 10]]
SAMPLINGS = {"t1": dict(temperature=1.0), "t07-topp09": dict(temperature=0.7, top_p=0.9), "greedy": dict(temperature=0.0)}
BUDGETS = {"fixed": dict(budget="fixed", fixed_nodes=8), "concurrency": dict(budget="concurrency", capacity=24),
           "concurrency-sync-free": dict(budget="concurrency", capacity=24, sync_free_trees=True),
           "cost-model": dict(budget="cost_model", min_gain=0.0)}
LOGPROB_TOLERANCE = 1e-4


def settings() -> list[str]:
    names = []
    for model in ("llama", "qwen2"):
        for sampling in SAMPLINGS:
            for budget in BUDGETS:
                for adaptation in ("static", "both"):
                    if budget == "concurrency-sync-free" and adaptation == "both":
                        continue  # the slow path's records read each pass on the host: never sync-free
                    names.append(f"{model}/{sampling}/{budget}/{adaptation}")
            names.append(f"{model}/{sampling}/fastgrpo")
    return names


def randomised(module: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """Drafts that differ from the policy's own (untrained heads are zero-initialised: the LM head alone)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return module


def model_for(model_type: str):
    """A 12-token vocabulary and peaky distributions: drafts are often accepted, several deep."""
    return build_tiny_model(model_type, seed=5, init_std=0.4, vocab_size=12, eos_token_ids=[1]).requires_grad_(False)


def generate(name: str) -> dict:
    """The responses, and the statistics that do not depend on timing, of one setting."""
    model_type, sampling, decoder, *rest = name.split("/")
    torch.manual_seed(0)
    model = model_for(model_type)
    params = SamplingParams(max_new_tokens=24, n=2, seed=11, **SAMPLINGS[sampling])
    if decoder == "fastgrpo":
        drafter = randomised(FeatureDrafter.for_model(model), seed=2, scale=0.05)
        cfg = FastGRPOConfig(drafter_path=None, capacity=32, max_nodes=8)
        engine = RolloutEngine(model, decoder=FastGRPODecoder(model, cfg))
        engine.decoder.set_drafter(drafter)
    else:
        cfg = SpeculationConfig(heads_path=None, adaptation=rest[0], **BUDGETS[decoder])
        engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg))
        engine.decoder.set_heads(randomised(HorizonHeads.for_model(model, "path", cfg.num_heads), seed=2, scale=0.3))
    out = engine.generate(PROMPTS, params)
    recorded = {"token_ids": out.token_ids, "logprobs": out.logprobs, "finish_reasons": out.finish_reasons}
    if decoder != "cost-model":
        recorded["stats"] = untimed_stats(out.stats)
        if rest and rest[0] == "both":
            recorded["head_records"] = head_records_summary(engine.decoder.pop_head_records())
    return recorded


def untimed_stats(stats: GenerationStats) -> dict:
    """An engine's statistics without the ones measured in seconds (or learned from them), under
    the names recorded: a tree decoder's fields beside the engine's, Reflex's prefixed `reflex_`."""
    records = [("", stats), ("", stats.tree), ("reflex_", stats.tree and stats.tree.reflex)]
    out = {}
    for prefix, record in records:
        for name in [f.name for f in fields(record)] if record is not None else []:
            value = getattr(record, name)
            if name.endswith("_s") or name == "compiles" or name in ("tree", "reflex"):
                continue
            if name.startswith("would_be_") or name == "tree_step_cost":
                continue  # recorded before would-be trees, which only plain steps score: none of these settings compared takes one
            out[prefix + name] = {str(k): v for k, v in sorted(value.items())} if isinstance(value, dict) else value
    return out


def head_records_summary(records) -> dict:
    telemetry, matured = records
    out = {"telemetry_records": telemetry.records.tolist(), "telemetry_accepted": telemetry.accepted.tolist(),
           "telemetry_trials": telemetry.trials.tolist()}
    if matured is not None:
        out |= {"matured": len(matured), "matured_tokens": matured.token.tolist(), "matured_heads": matured.head.tolist()}
    return out


def assert_close(actual, expected, where: str) -> None:
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert math.isclose(actual, expected, rel_tol=LOGPROB_TOLERANCE, abs_tol=LOGPROB_TOLERANCE), \
            f"{where}: {actual} != {expected}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


@pytest.mark.parametrize("name", settings())
def test_decoding_matches_recorded_values(name, recorded):
    assert_close(json.loads(json.dumps(generate(name))), recorded[name], name)


def test_recorded_settings_drafted_deep_trees(recorded):
    """The recorded settings exercise what they claim: trees accepted drafts at depth 2 and beyond."""
    deep = [name for name, r in recorded.items() if "stats" in r
            and any(int(k) >= 3 and v for k, v in r["stats"].get("tokens_per_step_hist", {}).items())]
    assert len(deep) >= len(recorded) // 2


if __name__ == "__main__" and "--record" in sys.argv:
    torch.set_num_threads(1)
    RECORDED.parent.mkdir(exist_ok=True)
    RECORDED.write_text(json.dumps({name: generate(name) for name in settings()}, indent=None, sort_keys=True))
    print(f"recorded {len(settings())} settings in {RECORDED}")
