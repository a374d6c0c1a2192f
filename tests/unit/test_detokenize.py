"""Incremental detokenization and stop strings (pure logic)."""

from __future__ import annotations

from kite_worker.engines.reference.detokenize import IncrementalDetokenizer, StopStringMatcher


def test_stop_string_split_across_deltas_is_never_released():
    m = StopStringMatcher(["END"])
    assert m.feed("hello E") == ("hello ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("D and more") == ("", True)


def test_false_alarm_prefix_is_released_later():
    m = StopStringMatcher(["END"])
    assert m.feed("E") == ("", False)
    assert m.feed("X") == ("EX", False)
    assert m.flush() == ""


def test_earliest_of_several_stops_wins_and_no_stops_pass_through():
    assert StopStringMatcher(["b", "a"]).feed("xxabc") == ("xx", True)
    assert StopStringMatcher([]).feed("anything") == ("anything", False)


def test_flush_releases_held_tail():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.flush() == "ST"


def test_incremental_detokenizer_holds_incomplete_characters():
    # A fake byte-level vocabulary: token 0 and 1 are the two bytes of "é".
    vocab = {0: b"\xc3", 1: b"\xa9", 2: b"a"}

    def decode(ids):
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    d = IncrementalDetokenizer(decode)
    assert d.add(2) == "a"
    assert d.add(0) == ""
    assert d.add(1) == "é"
    assert d.add(2) == "a"
