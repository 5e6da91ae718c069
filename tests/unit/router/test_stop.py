"""Stop strings on generated text: CASES S1-S3 at the text level."""

from __future__ import annotations

from router.stop import StopSequenceChecker


def feed_all(checker: StopSequenceChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    released: list[str] = []
    for delta in deltas:
        text, match = checker.feed(delta)
        released.append(text)
        if match is not None:
            return released, match.stop
    released.append(checker.flush())
    return released, None


def test_stop_spanning_two_tokens_s1() -> None:
    deltas = [" The", " capital", " is", " Pa", "ris"]
    released, stop = feed_all(StopSequenceChecker(["Pari"]), deltas)
    assert stop == "Pari"
    assert "".join(released) == " The capital is "


def test_partial_match_is_held_back_then_released_s2() -> None:
    checker = StopSequenceChecker(["END OF STORY"])
    assert checker.feed("once upon a time. EN") == ("once upon a time. ", None)
    assert checker.feed("D OF") == ("", None)
    # Ruled out: everything held comes back at once.
    assert checker.feed(" DAYS") == ("END OF DAYS", None)
    assert checker.flush() == ""


def test_long_stop_over_many_tokens_never_leaks_s2() -> None:
    deltas = ["a", "b", " <", "|", "st", "op", "|", ">", "tail"]
    released, stop = feed_all(StopSequenceChecker(["<|stop|>"]), deltas)
    assert stop == "<|stop|>"
    assert "".join(released) == "ab "
    assert all("<" not in piece for piece in released)


def test_single_token_stop_s3() -> None:
    released, stop = feed_all(StopSequenceChecker(["\n"]), ["Hello", " world", "\n", "more"])
    assert stop == "\n"
    assert "".join(released) == "Hello world"


def test_earliest_of_several_stops_wins() -> None:
    checker = StopSequenceChecker(["world", "lo w"])
    text, match = checker.feed("hello world")
    assert match is not None and match.stop == "lo w"
    assert text == "hel"


def test_no_stop_sequences_releases_everything() -> None:
    checker = StopSequenceChecker([])
    assert checker.feed("abc") == ("abc", None)
