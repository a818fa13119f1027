"""Stop strings: caught across token boundaries, never shown, nothing else held back."""

from __future__ import annotations

import random

from eagerlm.dispatch.stop_strings import StopMatcher


def feed(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces)
    return out + m.flush(), m.stopped


def test_no_stop_strings_passes_everything_through():
    assert feed([], ["Hel", "lo"]) == ("Hello", False)


def test_stop_string_inside_one_piece_cuts_there():
    assert feed(["END"], ["abcENDdef"]) == ("abc", True)


def test_stop_string_split_across_pieces_is_never_shown():
    assert feed(["</answer>"], ["42<", "/ans", "wer", ">more"]) == ("42", True)


def test_partial_match_that_fails_is_released():
    assert feed(["STOP"], ["ST", "OR", "Y"]) == ("STORY", False)


def test_the_text_cut_off_is_kept_for_whoever_needs_it():
    m = StopMatcher(["<tool_call>"])
    shown = m.push("Sure.<tool") + m.push("_call>{\"na")
    assert (shown, m.stopped, m.cut_off) == ("Sure.", True, "<tool_call>{\"na")
    assert m.push("me\"}") == "" and m.cut_off == "<tool_call>{\"na"


def test_earliest_of_several_stop_strings_wins():
    assert feed(["xyz", "b"], ["axyzb"]) == ("a", True)


def test_held_text_released_at_the_end():
    assert feed(["\n\n"], ["line\n"]) == ("line\n", False)


def test_randomized_against_plain_search():
    """Reference: str.find on the whole text, the shortest prefix before any stop."""
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(1, 2))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 4)))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = (text[:min(hits)], True) if hits else (text, False)
        assert feed(stops, pieces) == expected, (text, stops, pieces)
