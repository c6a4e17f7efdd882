"""A suffix index over texts kept per prompt: what followed a row's last tokens in other texts.

GRPO samples a group of responses to one prompt at once, and RL revisits every prompt each
epoch; those texts repeat one another (the question's numbers, the same calculation, the
same closing line), so what followed a row's last tokens in them is a cheap draft of what the
row says next (RhymeRL's HistoSpec, SRT, DAS). A store keeps texts under a key (a prompt),
indexes every n-gram of up to `max_ngram` tokens with where it occurred, and proposes, for a
row's context, the continuation most of the longest suffix's occurrences share, with how many
occurrences support each of its tokens.

Memory is bounded per key and in all, in tokens; the oldest text goes first. Pure Python on
the host: a draft source, never part of what verification computes.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import islice


@dataclass(frozen=True)
class SuffixProposal:
    """A continuation of a context, and how well the store's texts support it."""

    tokens: tuple[int, ...]  # the continuation, at each depth the token most occurrences continue with
    counts: tuple[int, ...]  # occurrences that continue with the path up to and including each depth
    matches: int  # occurrences of the matched suffix with at least one token after them
    ngram: int  # length of the matched suffix


@dataclass
class KeyTexts:
    """One key's texts, oldest first, and where each n-gram of them occurred."""

    texts: OrderedDict = field(default_factory=OrderedDict)  # text id -> its tokens (a list)
    index: dict = field(default_factory=dict)  # n-gram tuple -> {text id: [position after each occurrence]}
    tokens: int = 0  # tokens held under this key


class SuffixStore:
    """Texts under keys, indexed by their n-grams, proposing continuations (see the module docstring).

    max_ngram: the longest suffix matched. tokens_per_key, total_tokens: bounds on the tokens
    kept under one key and in all. max_matches: occurrences a proposal counts, the latest texts'.
    """

    def __init__(self, max_ngram: int, tokens_per_key: int, total_tokens: int, max_matches: int = 64) -> None:
        for name, value in (("max_ngram", max_ngram), ("tokens_per_key", tokens_per_key),
                            ("total_tokens", total_tokens), ("max_matches", max_matches)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_ngram, self.tokens_per_key, self.total_tokens = max_ngram, tokens_per_key, total_tokens
        self.max_matches = max_matches
        self.keys: dict[Hashable, KeyTexts] = {}
        self.age: OrderedDict = OrderedDict()  # (key, text id) of every text, oldest first
        self.tokens = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys

    def text(self, key: Hashable, text_id: Hashable) -> list[int] | None:
        """The tokens of one text (None if not held)."""
        held = self.keys.get(key)
        return None if held is None else held.texts.get(text_id)

    def extend(self, key: Hashable, text_id: Hashable, tokens: Sequence[int]) -> None:
        """Append `tokens` to text `text_id` under `key` (a new text if it is not held), then evict
        the oldest texts until both bounds hold."""
        held = self.keys.setdefault(key, KeyTexts())
        text = held.texts.get(text_id)
        if text is None:
            text = held.texts[text_id] = []
            self.age[(key, text_id)] = None
        for token in tokens:
            text.append(int(token))
            end = len(text)
            for n in range(1, min(self.max_ngram, end) + 1):
                held.index.setdefault(tuple(text[end - n:]), {}).setdefault(text_id, []).append(end)
        held.tokens += len(tokens)
        self.tokens += len(tokens)
        while held.tokens > self.tokens_per_key:
            self.evict(key, next(iter(held.texts)))
        while self.tokens > self.total_tokens:
            self.evict(*next(iter(self.age)))

    def evict(self, key: Hashable, text_id: Hashable) -> None:
        """Forget one text and its n-grams (the key too, once it holds no text)."""
        held = self.keys[key]
        text = held.texts.pop(text_id)
        del self.age[(key, text_id)]
        for end in range(1, len(text) + 1):
            for n in range(1, min(self.max_ngram, end) + 1):
                gram = tuple(text[end - n:end])
                places = held.index.get(gram)
                if places is not None and places.pop(text_id, None) is not None and not places:
                    del held.index[gram]
        held.tokens -= len(text)
        self.tokens -= len(text)
        if not held.texts:
            del self.keys[key]

    def propose(self, key: Hashable, context: Sequence[int], depth: int,
                exclude: Hashable | None = None) -> SuffixProposal | None:
        """The continuation of `context` that the texts under `key` (but text `exclude`) support
        most, up to `depth` tokens, after the longest suffix of `context` they hold with at least
        one token after it; None when no suffix of it occurs so."""
        held = self.keys.get(key)
        if held is None or depth < 1:
            return None
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            places = held.index.get(tuple(int(t) for t in context[len(context) - n:]))
            if not places:
                continue
            # The latest texts' occurrences first: ties go to the most recent text.
            found = list(islice(((held.texts[tid], end) for tid in reversed(places) if tid != exclude
                                 for end in reversed(places[tid]) if end < len(held.texts[tid])), self.max_matches))
            if found:
                return continuation(found, depth, n)
        return None

    def state_dict(self) -> dict:
        """Every text, oldest first, as plain lists (a checkpoint loads it with weights_only)."""
        return {"texts": [[key, text_id, list(self.keys[key].texts[text_id])] for key, text_id in self.age]}

    def load_state_dict(self, state: dict) -> None:
        """Replace what is held by `state_dict()`'s texts (the bounds of this store apply)."""
        self.keys, self.age, self.tokens = {}, OrderedDict(), 0
        for key, text_id, tokens in state["texts"]:
            self.extend(key, text_id, tokens)


def continuation(found: list[tuple[list[int], int]], depth: int, ngram: int) -> SuffixProposal:
    """The path most of `found`'s occurrences (text, position after the match) continue with,
    token by token: at each depth the majority among those that agreed so far (ties: the first listed)."""
    tokens, counts, alive = [], [], found
    for d in range(depth):
        votes = Counter(text[end + d] for text, end in alive if end + d < len(text))
        if not votes:
            break
        token, count = votes.most_common(1)[0]
        tokens.append(token)
        counts.append(count)
        alive = [(text, end) for text, end in alive if end + d < len(text) and text[end + d] == token]
    return SuffixProposal(tuple(tokens), tuple(counts), len(found), ngram)
