"""The suffix drafter on crafted sequences: matches, rollbacks, the job store, its bound, the
estimates it learns, and the combination of its sources."""

from __future__ import annotations

import random

import pytest

from pipespec_mpi.models.suffix import (
    SEP,
    Cells,
    Store,
    SuffixDrafter,
    TokenIndex,
    continuation,
    survival_cut,
)


def _index(tokens):
    ix = TokenIndex()
    ix.append(tokens)
    return ix


def _brute_tables(text):
    """What TokenIndex.one / .two must hold for ``text`` (positions after each token / pair)."""
    one, two = {}, {}
    for i, t in enumerate(text):
        if t == SEP:
            continue
        one.setdefault(t, []).append(i + 1)
        if i and text[i - 1] != SEP:
            two.setdefault((text[i - 1] << 32) | t, []).append(i + 1)
    return one, two


def test_empty_history_proposes_nothing():
    d = SuffixDrafter("s")
    d.prefill([], store_key="pipespec")
    assert d.propose([], 8, confirmed=0) == []
    d.prefill([5], store_key="pipespec")
    assert d.propose([5], 8, confirmed=1) == []  # one token, seen nowhere before


def test_an_output_it_did_not_draft_for_is_drafted_from_later():
    """learn: a prompt decoded without this stage (the online plan's AR) still joins its store."""
    d = SuffixDrafter("s", min_survival=0.0)
    d.learn([10, 11, 12, 13, 14, 15], store_key="online:b1")
    d.prefill([1, 10, 11, 12], store_key="online:b1")
    assert d.propose([1, 10, 11, 12], 3, confirmed=4) == [13, 14, 15]
    d.prefill([1, 10, 11, 12], store_key="pipespec:b1")  # another store knows nothing of it
    assert d.propose([1, 10, 11, 12], 3, confirmed=4) == []


def test_repeat_in_the_prompt_is_continued():
    d = SuffixDrafter("s", min_survival=0.0)
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    d.prefill(seq, store_key="pipespec")
    # the longest match (1 2 3) continues with 4 5 9 1 2 3, up to the query's own end
    assert d.propose(seq, 8, confirmed=len(seq)) == [4, 5, 9, 1, 2, 3]
    assert d.propose(seq, 2, confirmed=len(seq)) == [4, 5]


def test_longest_match_wins_over_a_more_recent_shorter_one():
    ix = _index([7, 1, 2, 3, 40, 8, 2, 3, 50, 1, 2, 3])
    m, places = ix.candidates(ix.text, 64, exclude=len(ix))
    assert m == 3 and places == [4]
    assert continuation(ix, places, len(ix), 4) == ([40, 8, 2, 3], [1.0, 1.0, 1.0, 1.0])


def test_continuation_follows_the_most_frequent_branch():
    # after "1 2": 3 twice, 4 once -> 3 with f = 2/3; both places agree on 5; then 9 or 7, a
    # tie that the most recent place decides
    ix = _index([1, 2, 3, 5, 9, 1, 2, 4, 6, 8, 1, 2, 3, 5, 7, 1, 2])
    m, places = ix.candidates(ix.text, 64, exclude=len(ix))
    assert m == 2 and places == [12, 7, 2]
    toks, freq = continuation(ix, places, len(ix), 3)
    assert toks == [3, 5, 7] and freq == [pytest.approx(2 / 3), 1.0, 0.5]


def test_index_rolls_back_and_forward_to_the_same_tables():
    rng = random.Random(3)
    ix = TokenIndex()
    text: list[int] = []
    for _ in range(300):
        if text and rng.random() < 0.3:
            keep = rng.randrange(len(text))
            ix.truncate(keep)
            del text[keep:]
        else:
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
            ix.append(new)
            text += new
        one, two = _brute_tables(text)
        assert ix.text == text and ix.one == one and ix.two == two


def test_drafter_follows_rollbacks_of_its_sequence():
    d = SuffixDrafter("s", min_survival=0.0)
    prompt = [1, 2, 3, 4, 1, 2]
    d.prefill(prompt, store_key="pipespec")
    assert d.propose(prompt, 4, confirmed=6) == [3, 4, 1, 2]
    # the verifier rejected the draft at its first token and committed 9 instead
    seq = prompt + [9]
    assert d.propose(seq, 4, confirmed=7) == []  # 9 never occurred before: nothing to say
    assert d.seq.text == seq
    assert d.counts.settled == {"sequence": 1} and d.counts.accepted == {}
    seq = prompt + [9, 1, 2]  # "1 2" continued with 3 and with 9: a tie, the most recent wins
    assert d.propose(seq, 2, confirmed=9) == [9, 1]


def test_misses_are_not_recomputed_while_the_sequence_stands_still():
    d = SuffixDrafter("s")
    d.prefill([5, 6], store_key="pipespec")
    for _ in range(5):
        assert d.propose([5, 6], 8, confirmed=2) == []
    assert (d.counts.misses, d.counts.cut) == (1, 0)


def test_job_store_drafts_from_earlier_outputs_of_the_same_method_only():
    d = SuffixDrafter("s", min_survival=0.0)
    out = [10, 11, 12, 13, 14, 15]
    d.prefill([1, 10, 11], store_key="sd")
    d.end_sequence(out)
    d.prefill([2, 10, 11], store_key="pipespec")  # another method: a store of its own
    assert d.propose([2, 10, 11], 4, confirmed=3) == []
    d.end_sequence([])
    d.prefill([3, 10, 11], store_key="sd")
    assert d.propose([3, 10, 11], 4, confirmed=3) == [12, 13, 14, 15]
    assert d.counts.proposals == {"job": 1}


def test_slots_share_the_store_and_estimates_but_not_the_sequence():
    a = SuffixDrafter("s", min_survival=0.0)
    b = a.for_slot()
    a.prefill([1, 2, 3, 1, 2], store_key="pipespec")
    b.prefill([7, 8], store_key="pipespec")
    a.end_sequence([3, 4, 5])
    assert b.store is a.store and b.cells is a.cells
    assert b.propose([7, 8, 3, 4], 2, confirmed=4) == [5]
    assert b.seq.text == [7, 8, 3, 4]


def test_store_keeps_within_its_bound_dropping_the_oldest():
    rng = random.Random(0)
    st = Store(500)
    docs = []
    for _ in range(200):
        doc = [rng.randrange(40) for _ in range(rng.randrange(1, 80))]
        docs.append(doc)
        st.add(doc)
        assert st.tokens <= 500
        kept = [t for t in st.index.text]
        one, two = _brute_tables(kept)
        shift = st.index.base  # the tables hold positions of the whole history
        assert {k: [p - shift for p in v] for k, v in st.index.one.items()} == one
        assert {k: [p - shift for p in v] for k, v in st.index.two.items()} == two
    # what is kept is the newest documents, whole, each followed by a separator, as many as fit
    kept = docs[-len(st.starts) :]
    assert st.index.text == [t for doc in kept for t in [*doc, SEP]]
    assert st.tokens == sum(map(len, kept)) <= 500 < st.tokens + len(docs[-len(kept) - 1])


def test_a_document_longer_than_the_bound_keeps_its_end():
    st = Store(4)
    st.add([1, 2, 3, 4, 5, 6])
    assert st.index.text == [3, 4, 5, 6, SEP] and st.tokens == 4
    st0 = Store(0)
    st0.add([1, 2])
    assert st0.tokens == 0


def test_survival_cut_and_expected_length():
    assert survival_cut([0.9, 0.9, 0.9], 0.5) == (3, pytest.approx(0.9 + 0.81 + 0.729))
    assert survival_cut([0.9, 0.5, 0.9], 0.5) == (1, pytest.approx(0.9))
    assert survival_cut([0.05], 0.1) == (0, 0.0)


def test_estimates_learn_from_what_the_verifier_commits():
    cells = Cells()
    key = Cells.key("sequence", 1, 1.0)
    prior = cells.estimate(key, 1.0)
    for _ in range(200):
        cells.observe(key, False, 1.0)
    assert cells.estimate(key, 1.0) < 0.01 < prior
    # a drafter whose one-token matches are always rejected stops proposing them
    d = SuffixDrafter("s", min_survival=0.1)
    d.prefill([1, 2, 5, 2], store_key="k")
    d.cells.q[Cells.key("sequence", 1, 1.0)] = 0.01
    assert d.propose([1, 2, 5, 2], 4, confirmed=4) == []
    assert (d.counts.misses, d.counts.cut) == (0, 1)  # a match, cut by its estimate


def test_the_source_expected_to_be_accepted_longest_is_chosen():
    d = SuffixDrafter("s", min_survival=0.05)
    d.prefill([0], store_key="k")
    d.end_sequence([20, 21, 22, 23, 24, 25, 26, 27])
    seq = [20, 21, 22, 23, 30, 21]  # the sequence: "21" once (m=1); the store: "23 .. 21"? no, "21 22 ..."
    d.prefill(seq[:1], store_key="k")
    # both sources match "21"; mark the store's cells as reliable, the sequence's as not
    for f in (2, 1, 0):
        d.cells.q[("job", 1, f)] = 0.95
        d.cells.q[("sequence", 1, f)] = 0.2
    got = d.propose(seq, 4, confirmed=len(seq))
    assert got == [22, 23, 24, 25] and d.counts.proposals == {"job": 1}
    for f in (2, 1, 0):
        d.cells.q[("job", 1, f)] = 0.2
        d.cells.q[("sequence", 1, f)] = 0.95
    seq2 = seq + [22, 23, 30, 21]
    assert d.propose(seq2, 4, confirmed=len(seq2)) == [22, 23, 30, 21]


def test_a_corpus_file_is_drafted_from_through_the_loader(tmp_path):
    from pipespec_mpi.config import compose_config
    from pipespec_mpi.models.loader import load_stage

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\nprint('unrelated paragraph')\n")
    cfg = compose_config(["hierarchy=tiny_suffix", f"hierarchy.stages.0.corpus={corpus}",
                          "hierarchy.stages.0.min_survival=0.0"])  # fmt: skip
    d = load_stage(cfg.hierarchy, 0, [])
    assert isinstance(d, SuffixDrafter) and d.corpus is not None and d.corpus.tokens > 0
    prompt = list(b"# sum\ndef add(a, b):\n    ret")  # the byte tokenizer's ids
    d.prefill(prompt, store_key="pipespec")
    assert bytes(d.propose(prompt, 8, confirmed=len(prompt))) == b"urn a + "
    assert d.counts.proposals == {"corpus": 1}


def test_config_names_every_bad_suffix_value():
    from pipespec_mpi.config import ConfigError, compose_config

    with pytest.raises(ConfigError) as err:
        compose_config(["hierarchy=tiny_suffix", "hierarchy.stages.0.min_survival=1.5",
                        "hierarchy.stages.0.max_match=0",
                        "hierarchy.stages.0.corpus=/no/such/file"])  # fmt: skip
    msg = str(err.value)
    assert "min_survival=1.5" in msg and "max_match=0" in msg and "corpus='/no/such/file'" in msg


def test_a_pair_seen_only_at_the_end_falls_back_to_the_last_token():
    # "7 3" is new (its only entry is the query's own end); "3" alone was followed by 4 before
    ix = _index([1, 3, 4, 5, 7, 3])
    assert ix.candidates(ix.text, 64, exclude=len(ix)) == (1, [2])
    d = SuffixDrafter("s", min_survival=0.0)
    d.prefill([1, 3, 4, 5, 7, 3], store_key="k")
    assert d.propose([1, 3, 4, 5, 7, 3], 3, confirmed=6) == [4, 5, 7]


def test_a_draft_on_a_rolled_back_context_is_forgotten_unjudged():
    d = SuffixDrafter("s", min_survival=0.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    d.prefill(prompt, store_key="k")
    first = d.propose(prompt, 2, confirmed=10)  # 3 4 at positions 10, 11
    second = d.propose(prompt + first, 2, confirmed=10)  # 1 2 at 12, 13, made on top of 3 4
    assert (first, second) == ([3, 4], [1, 2])
    before = dict(d.cells.q)
    # the verifier accepted 3, committed 9 instead of 4: the second draft's context is gone
    seq = [*prompt, 3, 9]
    d.propose(seq, 0, confirmed=12)
    assert d.counts.forgotten == 1
    assert d.counts.settled == {"sequence": 2} and d.counts.accepted == {"sequence": 1}
    # whatever is committed later where the forgotten draft stood does not judge it
    seq = [*seq, 5, 6]
    d.propose(seq, 0, confirmed=14)
    assert d.counts.settled == {"sequence": 2}
    changed = {k for k in d.cells.q if d.cells.q[k] != before.get(k)}
    assert changed <= {Cells.key("sequence", 4, 1.0)}  # only the first draft's cell learned


def test_a_draft_extending_unlikely_drafts_waits_for_the_verifier():
    d = SuffixDrafter("s", min_survival=0.1)
    prompt = [7, 1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3]  # "1 2 3" continues with 8 and 9: split
    d.prefill(prompt, store_key="k")
    for f in (0, 1, 2):
        for m in (1, 2, 3, 4):
            d.cells.q[Cells.key("sequence", m, 0.5 if f == 1 else 1.0 if f == 2 else 0.0)] = 0.3
    got = d.propose(prompt, 8, confirmed=12)
    assert len(got) == 1  # 0.3, then 0.09 < 0.1
    # on top of its own unconfirmed token (S_0 = 0.3) nothing is worth proposing
    assert d.propose(prompt + got, 8, confirmed=12) == []
    assert d.counts.cut == 1
    assert d.propose(prompt + got, 8, confirmed=12) == []  # asked again: the same answer
    assert d.counts.cut == 1
    # the verifier confirms it: S_0 is 1 again and the drafter proposes
    assert len(d.propose(prompt + got, 8, confirmed=13)) == 1


def test_a_cell_below_the_bound_drifts_back_towards_its_prior():
    cells = Cells()
    key = Cells.key("sequence", 1, 1.0)
    cells.q[key] = 0.01
    for _ in range(2000):
        cells.untried(key, 1.0)
    assert cells.estimate(key, 1.0) == pytest.approx(cells.prior(key, 1.0), abs=1e-3)
    assert cells.estimate(key, 1.0) <= cells.prior(key, 1.0)
    cells.q[key] = 0.9  # above its prior: a cut never raises it further (nor lowers it)
    cells.untried(key, 1.0)
    assert cells.q[key] == 0.9
    # the drafter drifts the cell that cut it, once per fresh call
    d = SuffixDrafter("s", min_survival=0.1)
    d.prefill([1, 2, 5, 2], store_key="k")
    d.cells.q[key] = 0.05
    assert d.propose([1, 2, 5, 2], 4, confirmed=4) == []
    q1 = d.cells.q[key]
    assert 0.05 < q1 < 0.1
    assert d.propose([1, 2, 5, 2], 4, confirmed=4) == []  # not a fresh call: no drift
    assert d.cells.q[key] == q1
    # enough cuts (each a fresh text ending in a one-token match of 2) reopen the cell
    seq, got = [1, 2, 5, 2], []
    for i in range(200):
        seq = [1, 2, 5, *[100 + i], 2]  # a new token before the last: the same cell, m = 1
        d.prefill(seq, store_key="k")
        got = d.propose(seq, 4, confirmed=len(seq))
        if got:
            break
    assert got == [5] and 0.1 <= d.cells.q[key] < 0.12
