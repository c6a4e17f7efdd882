"""Group siblings and earlier rollouts as draft sources, beside the heads and context lookup.

Siblings: the text the other responses of a row's GRPO group (rows of one prompt in one generate
call) have generated so far. History: the responses of earlier generate calls to the same prompt
(RL revisits every prompt each epoch), kept by the decoder of a rollout actor across calls and
saved with the run's checkpoint. Each source proposes, per row, the continuation its texts
support most after the row's last tokens (`suffix_store.SuffixStore`), as one chain that is merged
into the heads' candidates like context lookup's (`lookup.add_lookup_candidates`), scored by its
own online acceptance estimate: a node budget goes to whichever source is likelier to be accepted.

Texts are read on the host every step (the tree steps that use them read anyway). A prompt is
known by a digest of its token ids, so a rollout actor's history holds whatever prompts it was
given; actors sharing prompts each keep their own history, and none needs another's.

Exactness does not depend on it: verification samples every token from the policy whatever was
drafted, and with coupled draws emits plain decoding's tokens even where the chains' scores read
the coming draws (`reading`).
"""
from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .lookup import LookupAcceptance, LookupDrafts
from .suffix_store import SuffixProposal, SuffixStore

# A group's texts all fit in a generate call's sibling store: bounded by the call itself.
_UNBOUNDED = 1 << 62


def prompt_digest(prompt: Sequence[int]) -> str:
    """The key a prompt's history is kept under: a digest of its token ids."""
    return hashlib.sha1(",".join(map(str, prompt)).encode()).hexdigest()[:24]


class SuffixChains(NamedTuple):
    """A step's chains from each source (None: the source is off)."""

    siblings: LookupDrafts | None
    history: LookupDrafts | None


@dataclass
class CallTexts:
    """A generate call's sibling texts, kept while its rows finish and leave the batch."""

    state: weakref.ref  # the call's DecodeState
    siblings: SuffixStore  # keyed by group (row id // n), one text per row id
    digests: dict[int, str]  # group -> its prompt's digest
    consumed: dict[int, int]  # row id -> tokens of its history already in `siblings`


class SuffixDrafts:
    """A decoder's sibling and history sources: their chains each step, their acceptance
    estimates, and the history store (`remember` after each generate call)."""

    def __init__(self, siblings: bool, history: bool, max_ngram: int, tokens_per_prompt: int, total_tokens: int,
                 momentum: float, depth: int, device) -> None:
        self.use_siblings, self.max_ngram, self.device = siblings, max_ngram, device
        self.history = SuffixStore(max_ngram, tokens_per_prompt, total_tokens) if history else None
        self.next_text = 0  # id of the next response remembered
        self.call: CallTexts | None = None
        self.sibling_acceptance = LookupAcceptance(max_ngram, depth, momentum, device)
        self.history_acceptance = LookupAcceptance(max_ngram, depth, momentum, device)

    def restart_estimates(self, depth: int, momentum: float) -> None:
        """Both sources' acceptance estimates at their priors (new heads change what they compete with)."""
        self.sibling_acceptance = LookupAcceptance(self.max_ngram, depth, momentum, self.device)
        self.history_acceptance = LookupAcceptance(self.max_ngram, depth, momentum, self.device)

    def call_texts(self, state) -> CallTexts:
        """The sibling texts of `state`'s generate call (a new call starts empty)."""
        if self.call is None or self.call.state() is not state:
            self.call = CallTexts(weakref.ref(state), SuffixStore(self.max_ngram, _UNBOUNDED, _UNBOUNDED), {}, {})
        return self.call

    def chains(self, state, depth: int) -> SuffixChains:
        """Each live row's chain of up to `depth` tokens from each source on."""
        call = self.call_texts(state)
        lengths, prompt_lengths = state.history.lengths.tolist(), state.prompt_lengths.tolist()
        tokens = state.history.tokens[:, : max(lengths)].tolist()
        rows, live, group_size = state.row_ids.tolist(), state.live.tolist(), state.params.n
        siblings, history = [], []
        for row, row_id in enumerate(rows):
            text, end, group = tokens[row], lengths[row], row_id // group_size
            if group not in call.digests:
                call.digests[group] = prompt_digest(text[: prompt_lengths[row]])
            # A text starts with its prompt's last tokens, so a row's first tokens match in it.
            start = call.consumed.get(row_id, max(prompt_lengths[row] - self.max_ngram, 0))
            if self.use_siblings and end > start:  # rows finished in the last step still add their last tokens
                call.siblings.extend(group, row_id, text[start:end])
                call.consumed[row_id] = end
            context = text[max(end - self.max_ngram, 0): end]
            siblings.append(call.siblings.propose(group, context, depth, exclude=row_id) if live[row] else None)
            history.append(self.history.propose(call.digests[group], context, depth)
                           if live[row] and self.history is not None else None)
        return SuffixChains(self.as_chain(siblings, depth) if self.use_siblings else None,
                            self.as_chain(history, depth) if self.history is not None else None)

    def as_chain(self, proposals: list[SuffixProposal | None], depth: int) -> LookupDrafts:
        """Per-row proposals as the chains `lookup.add_lookup_candidates` merges (ngram 0: none)."""
        tokens = [list(p.tokens) + [0] * (depth - len(p.tokens)) if p else [0] * depth for p in proposals]
        valid = [[d < len(p.tokens) for d in range(depth)] if p else [False] * depth for p in proposals]
        ngram = [p.ngram if p else 0 for p in proposals]
        return LookupDrafts(torch.tensor(tokens, dtype=torch.long, device=self.device),
                            torch.tensor(valid, dtype=torch.bool, device=self.device),
                            torch.tensor(ngram, dtype=torch.long, device=self.device))

    def scored(self, chains: SuffixChains) -> list[tuple[LookupDrafts, torch.Tensor]]:
        """Each chain on, with its per-depth log acceptance estimates."""
        pairs = ((chains.siblings, self.sibling_acceptance), (chains.history, self.history_acceptance))
        return [(chain, acceptance.step_logp(chain)) for chain, acceptance in pairs if chain is not None]

    def learn(self, chains: SuffixChains, emitted: torch.Tensor, counts: torch.Tensor) -> None:
        """Update both sources' acceptance estimates from a pass's emitted tokens."""
        if chains.siblings is not None:
            self.sibling_acceptance.update(chains.siblings, emitted, counts)
        if chains.history is not None:
            self.history_acceptance.update(chains.history, emitted, counts)

    def remember(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], group_size: int) -> None:
        """Keep a generate call's `responses` (prompt-major, `group_size` per prompt) as history
        of their prompts; nothing when the history source is off."""
        if self.history is None:
            return
        for i, response in enumerate(responses):
            prompt = prompts[i // group_size]
            self.history.extend(prompt_digest(prompt), self.next_text, list(prompt[-self.max_ngram:]) + list(response))
            self.next_text += 1

    def history_state(self) -> dict | None:
        """The history store as plain lists (None when off), for a checkpoint."""
        if self.history is None:
            return None
        return {"next_text": self.next_text, **self.history.state_dict()}

    def load_history_state(self, state: dict) -> None:
        """Resume the history from `history_state()`'s output."""
        if self.history is None:
            raise ValueError("speculation.history_lookup is off: this decoder keeps no history to load")
        self.history.load_state_dict(state)
        self.next_text = int(state["next_text"])


def merged_history(states: Sequence[dict]) -> dict:
    """Several decoders' `history_state()` outputs as one, each text numbered afresh (their
    numbers clash across decoders), in the order given."""
    texts = [[key, number, tokens] for number, (key, _, tokens) in
             enumerate(text for state in states for text in state["texts"])]
    return {"next_text": len(texts), "texts": texts}
