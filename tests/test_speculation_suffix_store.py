"""The suffix store: continuations of a context in other texts of the same key, worked by hand."""
import pytest

from specroll.speculation.drafting.suffix_store import SuffixProposal, SuffixStore


def test_longest_suffix_and_the_majority_continuation():
    store = SuffixStore(max_ngram=3, tokens_per_key=100, total_tokens=100)
    store.extend("p", 0, [1, 2, 3, 4, 5])
    store.extend("p", 1, [9, 2, 3, 4, 6])
    store.extend("p", 2, [7, 3, 4, 6, 8])
    # "2 3 4" occurs twice (texts 0 and 1): the 3-gram wins over "3 4" (three occurrences).
    got = store.propose("p", [0, 2, 3, 4], depth=3)
    assert got == SuffixProposal(tokens=(6,), counts=(1,), matches=2, ngram=3)  # tie 5 / 6: the latest text's
    # "3 4": three occurrences, two continue with 6, and one of those with 8.
    assert store.propose("p", [3, 4], depth=3) == SuffixProposal((6, 8), (2, 1), 3, 2)
    assert store.propose("p", [42], depth=3) is None
    assert store.propose("q", [3, 4], depth=3) is None


def test_an_occurrence_at_the_end_of_a_text_and_the_excluded_text_propose_nothing():
    store = SuffixStore(max_ngram=2, tokens_per_key=100, total_tokens=100)
    store.extend("p", "row0", [5, 6, 7])
    store.extend("p", "row1", [5, 6])
    # Row 1's own "5 6" is its end; row 0 is ahead of it.
    assert store.propose("p", [5, 6], depth=4, exclude="row1") == SuffixProposal((7,), (1,), 1, 2)
    assert store.propose("p", [5, 6], depth=4, exclude="row0") is None
    store.extend("p", "row1", [7, 8])  # a growing text is indexed as it grows
    assert store.propose("p", [6, 7], depth=4, exclude="row0") == SuffixProposal((8,), (1,), 1, 2)


def test_bounds_evict_the_oldest_text_per_key_and_in_all():
    store = SuffixStore(max_ngram=2, tokens_per_key=8, total_tokens=10)
    store.extend("a", 0, [1, 2, 3])
    store.extend("a", 1, [1, 2, 4])
    store.extend("a", 2, [1, 2, 5])  # 9 tokens under "a": its oldest text goes
    assert store.text("a", 0) is None and store.propose("a", [1, 2], 1) == SuffixProposal((5,), (1,), 2, 2)
    store.extend("b", 0, [1, 2, 6, 7, 8])  # 11 in all: "a"'s oldest (text 1) goes
    assert store.tokens == 8 and store.text("a", 1) is None
    assert store.propose("a", [1, 2], 1) == SuffixProposal((5,), (1,), 1, 2)
    store.extend("b", 1, [9, 9, 9])  # 11 again: "a"'s last text goes, and "a" with it
    assert "a" not in store and store.tokens == 8
    # Evicted texts leave no n-gram behind.
    assert all(places for held in store.keys.values() for places in held.index.values())
    assert set(store.keys["b"].index) == {(1,), (2,), (6,), (7,), (8,), (9,), (1, 2), (2, 6), (6, 7), (7, 8), (9, 9)}


def test_state_round_trip_keeps_texts_in_age_order():
    store = SuffixStore(max_ngram=3, tokens_per_key=50, total_tokens=50)
    store.extend("p", 3, [1, 2, 3])
    store.extend("q", 4, [4, 5])
    store.extend("p", 5, [1, 2, 9])
    copy = SuffixStore(max_ngram=3, tokens_per_key=50, total_tokens=50)
    copy.load_state_dict(store.state_dict())
    assert copy.state_dict() == store.state_dict() == {"texts": [["p", 3, [1, 2, 3]], ["q", 4, [4, 5]], ["p", 5, [1, 2, 9]]]}
    assert copy.propose("p", [1, 2], 2) == store.propose("p", [1, 2], 2) == SuffixProposal((9,), (1,), 2, 2)
    smaller = SuffixStore(max_ngram=3, tokens_per_key=50, total_tokens=5)  # a smaller bound keeps the newest
    smaller.load_state_dict(store.state_dict())
    assert smaller.state_dict() == {"texts": [["q", 4, [4, 5]], ["p", 5, [1, 2, 9]]]}


def test_bad_bounds_are_named():
    with pytest.raises(ValueError, match="tokens_per_key"):
        SuffixStore(max_ngram=3, tokens_per_key=0, total_tokens=5)
