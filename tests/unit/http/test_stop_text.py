"""Stop strings found in streamed text, never sent and then taken back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvasir.http.generation import StopText


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopText(stops)
    out = ""
    for delta in deltas:
        text, stopped = matcher.push(delta)
        out += text
        if stopped:
            return out, True
    return out + matcher.flush(), False


def test_a_stop_string_split_across_deltas_is_cut_before_it_is_sent():
    matcher = StopText(["END"])
    assert matcher.push("abcE") == ("ab", False)  # "cE" could start "END": held back
    assert matcher.push("N") == ("c", False)  # "EN" still could
    assert matcher.push("Dzz") == ("", True)
    assert run(["\n\n", "."], ["one", ".", "two"]) == ("one", True)
    assert run([], ["a", "b"]) == ("ab", False)
    assert run([""], ["a"]) == ("a", False)  # an empty stop string stops nothing


@given(
    st.lists(st.text(alphabet="abc", max_size=4), max_size=12),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
)
def test_the_text_sent_is_the_text_up_to_the_first_stop(deltas, stops):
    whole = "".join(deltas)
    cuts = [whole.find(stop) for stop in stops if whole.find(stop) >= 0]
    out, stopped = run(stops, deltas)
    if cuts:
        # cut where a stop string starts, and no stop string whole in what was sent
        assert stopped and whole.startswith(out)
        assert any(whole[len(out) :].startswith(stop) for stop in stops)
        assert not any(stop in out for stop in stops)
    else:
        assert (out, stopped) == (whole, False)
