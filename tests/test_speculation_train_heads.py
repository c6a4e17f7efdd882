"""Head pretraining by self-distillation, on a tiny random policy with peaky distributions."""
from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder
from specroll.speculation.head_training.loss import sparse_kl_and_nll
from specroll.speculation.head_training.samples import (
    SampleConfig,
    SampledSequence,
    collect_samples,
    frequent_tokens,
    heldout_prompts,
    split_heldout,
)
from specroll.speculation.head_training.targets import compute_targets, sparse_distribution
from specroll.speculation.head_training.training import HeadTrainConfig, evaluate_heads, train_heads
from specroll.tools.train_heads import initial_heads, parse_args

SAMPLES = SampleConfig(positions=4000, prompts_per_batch=16, samples_per_prompt=4, max_new_tokens=48)
# A hidden size of 32 needs head weights of order one: a larger step than SmolLM2's 1e-3.
TRAIN = HeadTrainConfig(epochs=5, lr=3e-2, batch_positions=128, eval_every=1000)


def peaky_policy(model_type: str = "llama", **overrides):
    """A tiny random policy whose next token depends mostly on the current one, as in text.

    In a plain random tiny model the attention and MLP outputs swamp the token embedding, so
    its distributions are a chaotic function of the context and heads have nothing to learn.
    Scaling those branches down keeps some context dependence but lets the current token
    dominate. init_std=0.5 gives about 2 nats of entropy, near SmolLM2's 1.7 on GSM8K.
    """
    model = build_tiny_model(model_type, init_std=0.5, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.01)
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def policy():
    return peaky_policy()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 9, (64,), generator=g).tolist()
    return [torch.randint(2, 64, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def heldout(prompts):
    return heldout_prompts(len(prompts), SAMPLES.seed, every=8)


@pytest.fixture(scope="module")
def samples(policy, prompts, heldout, tmp_path_factory):
    collection = collect_samples(policy, prompts, SAMPLES, tmp_path_factory.mktemp("samples"), progress=False)
    return split_heldout(collection.sequences, heldout)


@pytest.fixture(scope="module")
def trained(policy, samples):
    """{head_type: (untrained heads, trained heads, metrics)}"""
    train, heldout = samples
    out = {}
    for head_type in ("medusa", "path"):
        heads = HorizonHeads.for_model(policy, head_type, 4)
        untrained = HorizonHeads.for_model(policy, head_type, 4)
        metrics = train_heads(policy, heads, train, TRAIN, heldout, progress=False, log=lambda _: None)
        out[head_type] = (untrained, heads, metrics)
    return out


def test_sparse_kl_matches_hand_worked_case():
    # p = (0.5, 0.3, 0.2) kept as top-1 + tail (0.5); q = softmax(0, 0, 0) = 1/3 each.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    top_logp, top_idx, tail_logp = sparse_distribution(logits, top_k=1)
    assert top_idx.tolist() == [[0]]
    assert torch.allclose(tail_logp.exp(), torch.tensor([0.5]))
    kl, nll = sparse_kl_and_nll(torch.zeros(1, 3), top_logp, top_idx, tail_logp, torch.tensor([2]))
    expected = 0.5 * math.log(0.5 / (1 / 3)) + 0.5 * math.log(0.5 / (2 / 3))
    assert kl.item() == pytest.approx(expected, abs=1e-6)
    assert nll.item() == pytest.approx(math.log(3), abs=1e-6)
    # Identical distributions: zero KL; with the full support kept it is the exact KL.
    kl, _ = sparse_kl_and_nll(logits, top_logp, top_idx, tail_logp, torch.tensor([0]))
    assert kl.item() == pytest.approx(0.0, abs=1e-6)


def test_targets_line_up_with_the_policy(policy, samples):
    seq = samples[0][0]
    targets = compute_targets(policy, [seq], top_k=8, progress=False)
    assert len(targets) == seq.response_len
    assert targets.next_token.tolist() == list(seq.ids[seq.prompt_len:])
    assert targets.remaining.tolist() == list(range(seq.response_len - 1, -1, -1))
    out = policy(torch.tensor([seq.ids]))
    t = seq.prompt_len + 2  # entry 3 is position prompt_len + 2
    assert torch.allclose(targets.hidden[3].float(), out.hidden[0, t], atol=2e-2, rtol=2e-2)
    logp = torch.log_softmax(out.logits[0, t], -1)
    assert targets.top_idx[3, 0].item() == int(logp.argmax())
    assert torch.allclose(targets.top_logp[3], logp.topk(8).values, atol=1e-5)


def assert_heads_learned(metrics: dict) -> None:
    before, after = metrics["eval"][0], metrics["eval"][-1]
    assert metrics["eval_positions"] > 100
    assert after["loss"] < 0.8 * before["loss"]
    assert after["per_head"][0]["top1"] > before["per_head"][0]["top1"] + 0.1
    assert after["per_head"][0]["mass4"] > before["per_head"][0]["mass4"]


@pytest.mark.parametrize("head_type", ["medusa", "path"])
def test_training_lowers_loss_and_raises_agreement(trained, head_type):
    assert_heads_learned(trained[head_type][2])


def test_heads_learn_a_qwen3_policy_as_a_llama_one(prompts, heldout, tmp_path):
    """Qwen3: query/key norms, attention heads wider than hidden / heads. Untied: tied to the
    embedding that dominates its input, this policy would repeat the current token every time."""
    policy = peaky_policy("qwen3", tie_word_embeddings=False)
    train, held = split_heldout(collect_samples(policy, prompts, SAMPLES, tmp_path, progress=False).sequences, heldout)
    heads = HorizonHeads.for_model(policy, "path", 4)
    assert_heads_learned(train_heads(policy, heads, train, TRAIN, held, progress=False, log=lambda _: None))


def test_path_heads_beat_medusa_heads_at_depth_two(trained):
    """Head 2 of a path head sees x_{t+1} and x_{t+2}; a medusa head has to guess both."""
    medusa = trained["medusa"][2]["eval"][-1]["per_head"][1]["top1"]
    path = trained["path"][2]["eval"][-1]["per_head"][1]["top1"]
    assert path > medusa


def test_policy_stays_frozen(samples):
    policy = build_tiny_model(init_std=0.3)  # parameters requiring grad, as loaded for GRPO
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    heads = HorizonHeads.for_model(policy, "path", 2)
    train_heads(policy, heads, samples[0][:16], HeadTrainConfig(epochs=1, batch_positions=64), progress=False)
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in policy.parameters())
    assert any(p.abs().sum() > 0 for p in heads.parameters())


@pytest.mark.parametrize("head_type", ["medusa", "path"])
def test_save_load_roundtrip(trained, policy, tmp_path, head_type):
    _, heads, _ = trained[head_type]
    path = tmp_path / "heads.safetensors"
    heads.save(path)
    loaded = HorizonHeads.load(path, policy)
    hidden = torch.randn(5, policy.config.hidden_size)
    emb = policy.embed_tokens(torch.randint(0, 64, (5, 4)))
    expected = policy.lm_head(heads.all_states(hidden, emb if head_type == "path" else None))
    got = policy.lm_head(loaded.all_states(hidden, emb if head_type == "path" else None))
    assert torch.equal(got, expected)
    assert loaded.head_type == head_type and loaded.num_heads == 4


def test_bfloat16_save_halves_the_file(trained, policy, tmp_path):
    _, heads, _ = trained["path"]
    heads.save(tmp_path / "f32.safetensors")
    heads.save(tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    assert (tmp_path / "bf16.safetensors").stat().st_size < 0.6 * (tmp_path / "f32.safetensors").stat().st_size
    loaded = HorizonHeads.load(tmp_path / "bf16.safetensors", policy)
    for a, b in zip(loaded.parameters(), heads.parameters()):
        assert a.dtype == torch.float32
        assert torch.allclose(a, b, atol=1e-2, rtol=1e-2)


def test_sample_cache_is_reused_and_extended(policy, prompts, tmp_path):
    small = SampleConfig(positions=300, prompts_per_batch=4, samples_per_prompt=2, max_new_tokens=24)
    first = collect_samples(policy, prompts, small, tmp_path, progress=False)
    assert first.new_batches > 0 and first.path.parent == tmp_path
    assert sum(s.response_len for s in first.sequences) >= 300
    mtime = first.path.stat().st_mtime_ns
    again = collect_samples(policy, prompts, small, tmp_path, progress=False)
    assert again.new_batches == 0
    assert again.sequences == first.sequences
    assert first.path.stat().st_mtime_ns == mtime
    larger = SampleConfig(**{**small.__dict__, "positions": 700})
    more = collect_samples(policy, prompts, larger, tmp_path, progress=False)
    assert more.path == first.path and 0 < more.new_batches
    assert more.sequences[: len(first.sequences)] == first.sequences
    # Grown in two steps or fresh in one: the same samples.
    fresh = collect_samples(policy, prompts, larger, tmp_path / "fresh", progress=False)
    assert fresh.sequences == more.sequences
    # Another seed is another cache file.
    other = collect_samples(policy, prompts, SampleConfig(**{**small.__dict__, "seed": 1}), tmp_path, progress=False)
    assert other.path != first.path and other.new_batches > 0


def test_heldout_prompts_are_spread_over_the_sampling_order(policy, prompts, tmp_path):
    cfg = SampleConfig(positions=100, prompts_per_batch=4, samples_per_prompt=2, max_new_tokens=24)
    held = heldout_prompts(len(prompts), cfg.seed, every=4)
    assert len(held) == 16
    collection = collect_samples(policy, prompts, cfg, tmp_path, progress=False)
    train, heldout = split_heldout(collection.sequences, held)
    # One prompt in four, from the first batch on, with all of its samples.
    assert len(heldout) == len(collection.sequences) // 4 and heldout
    assert not {s.prompt_index for s in train} & {s.prompt_index for s in heldout}
    with pytest.raises(ValueError, match="every"):
        heldout_prompts(len(prompts), cfg.seed, every=1)


def test_cut_short_last_line_is_dropped_and_the_cache_grows_on(policy, prompts, tmp_path):
    cfg = SampleConfig(positions=200, prompts_per_batch=4, samples_per_prompt=2, max_new_tokens=24)
    first = collect_samples(policy, prompts, cfg, tmp_path, progress=False)
    whole = first.path.read_bytes()
    with first.path.open("a") as f:
        f.write('{"batch": 99, "sequences": [{"ids": [1, 2')
    again = collect_samples(policy, prompts, cfg, tmp_path, progress=False)
    assert again.sequences == first.sequences and again.new_batches == 0
    assert first.path.read_bytes() == whole
    # A last record complete but for its newline is torn too (kept, the next batch would be glued to it).
    first.path.write_bytes(whole[:-1])
    again = collect_samples(policy, prompts, cfg, tmp_path, progress=False)
    assert again.sequences == first.sequences and again.new_batches == 1
    assert first.path.read_bytes() == whole
    # Grown after a cut: the same file as one grown in one go.
    first.path.write_bytes(whole + b'{"batch": 9')
    larger = SampleConfig(**{**cfg.__dict__, "positions": 500})
    more = collect_samples(policy, prompts, larger, tmp_path, progress=False)
    fresh = collect_samples(policy, prompts, larger, tmp_path / "fresh", progress=False)
    assert more.new_batches > 0 and more.sequences == fresh.sequences
    assert more.path.read_bytes() == fresh.path.read_bytes()


@pytest.mark.parametrize("bad", [b'{"batch": 1, "sequences": [{"ids": [1, 2', b"", b'{"batch": 1}',
                                 b'{"batch": 1, "sequences": [{"ids": [1, 2]}]}'],
                         ids=["cut_short", "empty", "no_sequences", "no_prompt_len"])
@pytest.mark.parametrize("where", ["middle", "last"])
def test_unreadable_whole_line_raises_and_leaves_the_file(policy, prompts, tmp_path, bad, where):
    cfg = SampleConfig(positions=400, prompts_per_batch=4, samples_per_prompt=2, max_new_tokens=24)
    path = collect_samples(policy, prompts, cfg, tmp_path, progress=False).path
    lines = path.read_bytes().split(b"\n")[:-1]
    assert len(lines) >= 3
    number = 2 if where == "middle" else len(lines)  # a last line with its newline was written whole
    lines[number - 1] = bad
    # A cut-short tail as well: nothing is written before every line has been read.
    corrupt = b"".join(line + b"\n" for line in lines) + b'{"batch": 9'
    path.write_bytes(corrupt)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, line {number}: "):
        collect_samples(policy, prompts, cfg, tmp_path, progress=False)
    assert path.read_bytes() == corrupt


@pytest.mark.parametrize("head_type", ["medusa", "path"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trained_heads_accept_more_tokens_per_step(trained, policy, prompts, heldout, head_type, temperature):
    untrained, heads, _ = trained[head_type]
    params = SamplingParams(temperature=temperature, max_new_tokens=48, n=2, seed=7)
    held = [prompts[i] for i in sorted(heldout)]  # prompts the heads never trained on
    tokens_per_step = []
    for h in (untrained, heads):
        spec = SpeculationConfig(head_type=head_type, heads_path=None, budget="fixed", fixed_nodes=8)
        engine = RolloutEngine(policy, decoder=SpeculativeDecoder(policy, spec))
        engine.decoder.set_heads(h)
        tokens_per_step.append(engine.generate(held, params).stats.tree.tokens_per_step_mean)
    assert tokens_per_step[1] > tokens_per_step[0] + 0.1, tokens_per_step


def init_args(**given):
    import argparse

    return argparse.Namespace(**({"init_heads": None, "head_type": "path", "num_heads": 4, "head_layers": None} | given))


def test_warm_start_takes_the_given_heads(trained, policy, tmp_path):
    _, heads, _ = trained["path"]
    heads.save(tmp_path / "heads.safetensors")
    fresh = initial_heads(policy, init_args())
    assert all(float(p.detach().abs().sum()) == 0 for name, p in fresh.named_parameters() if name.endswith("weight"))
    warm = initial_heads(policy, init_args(init_heads=str(tmp_path / "heads.safetensors")))
    for a, b in zip(warm.parameters(), heads.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="holds 4 path heads, but --head-type medusa"):
        initial_heads(policy, init_args(init_heads=str(tmp_path / "heads.safetensors"), head_type="medusa"))
    # An alias means that model's shipped heads: SmolLM2's, which this tiny policy refuses.
    with pytest.raises(ValueError, match="were made for model .*smollm2-135m-instruct"):
        initial_heads(policy, init_args(init_heads="smollm2-135m-instruct"))


def test_deepened_heads_draft_as_before_then_train_their_new_layers(trained, policy, samples, tmp_path):
    _, heads, _ = trained["path"]
    heads.save(tmp_path / "heads.safetensors")
    deep = initial_heads(policy, init_args(init_heads=str(tmp_path / "heads.safetensors"), head_layers=3))
    assert deep.num_layers == 3 and len(deep.layers[0]) == 2
    hidden = torch.randn(5, policy.config.hidden_size)
    emb = policy.embed_tokens(torch.randint(0, 64, (5, 4)))
    assert torch.equal(deep.all_states(hidden, emb), heads.all_states(hidden, emb))  # untrained layers: identity
    deep.save(tmp_path / "deep.safetensors")
    with pytest.raises(ValueError, match="has 3 layers per head; --head-layers 2 would drop trained ones"):
        initial_heads(policy, init_args(init_heads=str(tmp_path / "deep.safetensors"), head_layers=2))

    train, heldout = samples
    cfg = HeadTrainConfig(epochs=1, lr=3e-2, batch_positions=128, eval_every=1000)
    train_heads(policy, deep, train, cfg, heldout, progress=False, log=lambda _: None)
    assert all(float(layer.weight.abs().sum()) > 0 for head in deep.layers for layer in head)
    deep.save(tmp_path / "trained.safetensors")
    loaded = HorizonHeads.load(tmp_path / "trained.safetensors", policy)
    assert loaded.num_layers == 3 and torch.equal(loaded.all_states(hidden, emb), deep.all_states(hidden, emb))
    assert not torch.equal(loaded.all_states(hidden, emb), heads.all_states(hidden, emb))


def test_frequent_tokens_are_the_most_common_response_tokens():
    seqs = [SampledSequence((9, 9, 4, 4, 4, 7), 2, 0), SampledSequence((9, 5, 7, 7), 1, 1)]
    # response tokens: 4 4 4 7 | 5 7 7  ->  7 x3, 4 x3, 5 x1 (the prompts' 9s do not count)
    assert frequent_tokens(seqs, 2).tolist() == [4, 7]
    assert frequent_tokens(seqs, 10).tolist() == [4, 5, 7]


def test_draft_vocabulary_survives_save_load_and_state_dict_updates(trained, policy, tmp_path):
    _, heads, _ = trained["path"]
    narrow = copy.deepcopy(heads)
    narrow.set_draft_vocab(torch.tensor([3, 1, 60]))
    narrow.save(tmp_path / "heads.safetensors", dtype=torch.bfloat16)
    loaded = HorizonHeads.load(tmp_path / "heads.safetensors", policy)
    assert loaded.draft_vocab.tolist() == [3, 1, 60] and loaded.draft_vocab.dtype == torch.long
    # A rollout actor applies published heads with load_state_dict: vocabularies of any size or none.
    loaded.load_state_dict(heads.state_dict())
    assert loaded.draft_vocab is None
    loaded.load_state_dict(narrow.state_dict())
    assert loaded.draft_vocab.tolist() == [3, 1, 60]


def test_evaluation_alone_matches_training_step_zero_and_sees_the_draft_vocabulary(trained, policy, samples):
    untrained, heads, metrics = trained["path"]
    _, heldout = samples
    cfg = HeadTrainConfig(eval_positions=TRAIN.eval_positions)
    alone = evaluate_heads(policy, untrained, heldout, cfg, progress=False, log=lambda _: None)
    assert alone["eval"][0]["loss"] == pytest.approx(metrics["eval"][0]["loss"], rel=1e-5)
    full = evaluate_heads(policy, heads, heldout, cfg, progress=False, log=lambda _: None)["eval"][0]
    narrow = copy.deepcopy(heads)
    narrow.set_draft_vocab(torch.arange(0, 64, 2))  # odd tokens can no longer be guessed
    cut = evaluate_heads(policy, narrow, heldout, cfg, progress=False, log=lambda _: None)["eval"][0]
    assert cut["per_head"][0]["top1"] < full["per_head"][0]["top1"]
    assert cut["per_head"][0]["kl"] == pytest.approx(full["per_head"][0]["kl"])  # the heads themselves are unchanged


def test_out_is_required_only_when_training():
    assert parse_args(["--collect-only"]).out is None
    assert parse_args(["--out", "h.safetensors"]).out == "h.safetensors"
    with pytest.raises(SystemExit):
        parse_args([])


def test_targets_over_a_vocabulary_are_the_policy_restricted_and_renormalised(policy, samples):
    seq = samples[0][0]
    vocab = torch.arange(0, 64, 2)  # the even tokens
    targets = compute_targets(policy, [seq], top_k=8, progress=False, vocab=vocab)
    assert targets.next_token.tolist() == list(seq.ids[seq.prompt_len:])  # path inputs stay model ids
    assert targets.target_token.tolist() == [t // 2 if t % 2 == 0 else -1 for t in seq.ids[seq.prompt_len:]]
    out = policy(torch.tensor([seq.ids]))
    t = seq.prompt_len + 2
    restricted = torch.log_softmax(out.logits[0, t, vocab], -1)
    assert torch.allclose(targets.top_logp[3], restricted.topk(8).values, atol=1e-5)
    assert targets.top_idx[3].tolist() == restricted.topk(8).indices.tolist()
    mass = targets.top_logp[3].exp().sum() + targets.tail_logp[3].exp()
    assert mass.item() == pytest.approx(1.0, abs=1e-5)


def test_token_outside_the_vocabulary_has_no_nll():
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    top_logp, top_idx, tail_logp = sparse_distribution(logits, top_k=1)
    kl, nll = sparse_kl_and_nll(torch.zeros(2, 3), top_logp, top_idx, tail_logp, torch.tensor([1, -1]))
    assert nll.tolist() == pytest.approx([math.log(3), 0.0], abs=1e-6)
    assert kl[0].item() == pytest.approx(kl[1].item())


def test_training_on_a_draft_vocabulary_raises_agreement_within_it(policy, samples):
    train, heldout = samples
    heads = HorizonHeads.for_model(policy, "path", 2)
    heads.set_draft_vocab(frequent_tokens(train, 32))
    cfg = HeadTrainConfig(epochs=3, lr=3e-2, batch_positions=128, eval_every=1000)
    metrics = train_heads(policy, heads, train, cfg, heldout, progress=False, log=lambda _: None)
    first, last = metrics["eval"][0]["per_head"][0], metrics["eval"][-1]["per_head"][0]
    assert metrics["loss_last"] < 0.7 * metrics["loss_first"]
    assert last["top1"] > first["top1"] + 0.2
    assert last["mass4"] > first["mass4"] + 0.1
