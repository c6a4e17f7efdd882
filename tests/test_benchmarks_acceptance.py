"""The yield benchmark: which sources it can measure alone, and a tiny end-to-end run whose
sources, blind and reading the draws, decode the same responses and stay under their bounds (the
oracle for blind drafts, every node accepted for reading ones), and whose would-be trees score the
heads' drafts on those responses decoded plain."""
import json

import pytest

from specroll.benchmarks.acceptance import (
    COMBINED,
    DRAFTS,
    SAMPLINGS,
    SOURCES,
    base_config,
    config_overrides,
    main,
    markdown_table,
    source_settings,
)
from specroll.speculation import SpeculationConfig


def test_a_source_runs_alone_only_where_every_other_source_can_be_switched_off():
    # Heads have no switch today: they run alone (lookup off), lookup never does.
    assert source_settings({"heads": None, "lookup": "context_lookup"}) == {
        "heads": {"context_lookup": False}, COMBINED: {"context_lookup": True}}
    table = {"heads": "head_drafts", "lookup": "context_lookup", "siblings": "sibling_lookup"}
    settings = source_settings(table)
    assert list(settings) == ["heads", "lookup", "siblings", COMBINED]
    assert settings["lookup"] == {"head_drafts": False, "context_lookup": True, "sibling_lookup": False}
    assert settings[COMBINED] == {"head_drafts": True, "context_lookup": True, "sibling_lookup": True}
    assert source_settings({"heads": None}) == {"heads": {}}  # one source: nothing to combine


def test_every_shipped_source_switch_is_a_speculation_config_field():
    for overrides in source_settings(SOURCES).values():
        SpeculationConfig(**overrides)


def test_a_tiny_run_measures_every_source_under_the_oracle_and_draws_the_figure(tmp_path):
    out = tmp_path / "acceptance.json"
    result = main(["--tiny", "--threads", "1", "--prompts", "2", "--group", "4", "--max-new-tokens", "16",
                   "--budgets", "4", "8", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    rows = saved["rows"]
    sources = list(source_settings(SOURCES))
    assert [(r["sampling"], r["budget"], r["source"], r["drafts"]) for r in rows] == [
        (s, b, name, drafts) for s in SAMPLINGS for b in (4, 8) for name in sources for drafts in DRAFTS]
    for row in rows:
        assert row["same_responses"] == 1.0  # coupled draws: only the drafts differ
        assert len(row["tokens_per_pass_by_epoch"]) == 2 and len(row["oracle_tokens_per_pass_by_epoch"]) == 2
        assert row["bound_tokens_per_pass"] == min(row["budget"], 5)  # the tiny heads draft 4 deep
        assert row["fraction_of_oracle"] == row["tokens_per_pass"] / row["oracle_tokens_per_pass"]
        assert row["break_even_plain_steps"] == row["tokens_per_pass"]
        if row["drafts"] == "reading":  # past the blind oracle, never past every node accepted
            assert 1.0 < row["tokens_per_pass"] <= row["bound_tokens_per_pass"]
            blind = next(r for r in rows if (r["sampling"], r["budget"], r["source"], r["drafts"])
                         == (row["sampling"], row["budget"], row["source"], "blind"))
            assert row["reading_vs_blind"] == row["tokens_per_pass"] / blind["tokens_per_pass"] - 1
            continue
        assert 1.0 < row["tokens_per_pass"] <= row["oracle_tokens_per_pass"] * 1.02
        if row["source"] != "heads":  # --would-be's default
            assert "would_be_tokens_per_pass" not in row
            continue
        # Decoded plain with coupled draws: the responses of the heads' trees.
        assert row["would_be_same_responses"] == 1.0 and row["would_be_passes"] > 0
        assert row["would_be_vs_trees"] == row["would_be_tokens_per_pass"] / row["tokens_per_pass"] - 1
        assert abs(row["would_be_vs_trees"]) < 0.05  # the same drafts scored, not run
    for s in SAMPLINGS:
        oracle = [r["oracle_tokens_per_pass"] for r in rows if (r["sampling"], r["source"], r["drafts"]) == (s, sources[0], "blind")]
        assert oracle[1] > oracle[0]  # a larger budget lets a perfect drafter emit more
    combined = {r["drafts"]: r["tokens_per_pass"] for r in rows if (r["sampling"], r["budget"], r["source"]) == ("T=1", 8, COMBINED)}
    assert combined["reading"] > combined["blind"]  # at T=1 the draws' noise read: more of each tree is the draw
    assert result["table"] == markdown_table(rows) and len(result["table"].splitlines()) == 2 + 2 * len(SAMPLINGS)
    assert result["table"].splitlines()[0].endswith("| would-be (heads blind) |")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_set_changes_speculation_config_fields_read_as_yaml_and_names_a_bad_one():
    overrides = config_overrides(["max_frontier=8", "calibration_momentum=0.5", "context_lookup=false"])
    assert overrides == {"max_frontier": 8, "calibration_momentum": 0.5, "context_lookup": False}
    cfg = base_config("path", 3, overrides)
    assert (cfg.max_frontier, cfg.calibration_momentum, cfg.context_lookup) == (8, 0.5, False)
    assert (cfg.num_heads, cfg.budget, cfg.max_children) == (3, "fixed", SpeculationConfig().max_children)
    with pytest.raises(ValueError, match="max_frontier must be an int"):
        base_config("path", 4, config_overrides(["max_frontier=many"]))
    with pytest.raises(ValueError, match="max_fronteir: unknown key"):
        base_config("path", 4, config_overrides(["max_fronteir=8"]))
    with pytest.raises(ValueError, match="KEY=VALUE"):
        config_overrides(["max_frontier"])


def test_a_run_measures_only_the_sources_and_samplings_asked_for_with_the_config_set(tmp_path):
    result = main(["--tiny", "--threads", "1", "--prompts", "1", "--group", "4", "--max-new-tokens", "12",
                   "--budgets", "4", "--epochs", "1", "--sources", "heads", COMBINED, "--samplings", "T=1", "--would-be", "none",
                   "--drafts", "reading", "--set", "max_frontier=2", "max_children=3", "--json", str(tmp_path / "a.json")])
    assert [(r["sampling"], r["source"], r["drafts"]) for r in result["rows"]] == [("T=1", "heads", "reading"),
                                                                                  ("T=1", COMBINED, "reading")]
    assert not any("would_be_tokens_per_pass" in r for r in result["rows"])
    assert (result["config"]["max_frontier"], result["config"]["max_children"]) == (2, 3)
    assert len(result["table"].splitlines()) == 3


def test_reading_drafts_need_the_gumbel_sampler():
    with pytest.raises(SystemExit):
        main(["--tiny", "--drafts", "reading", "--sampler", "inverse_cdf"])
