"""The shaped-link harness (torchfeed.tools.link): a loopback capped by tc's tbf bounds what
a RemoteDataLoader delivers, and the loader fills that link."""

from __future__ import annotations

import pytest

from torchfeed.tools import link

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(link.shaping_available() is not None, reason=str(link.shaping_available())),
]


def test_a_shaped_link_bounds_and_is_filled():
    (row,) = link.run(["200mbit"], ["photos"], seconds=2.0)
    assert row["rate"] == "200mbit" and row["kind"] == "photos"
    # incompressible bytes cannot cross faster than the link (framing and tags cost a little),
    # and with 2 workers the loader keeps the link busy
    assert 0.5 < row["link_share"] < 1.1, row


def test_rates_are_read_in_tcs_units():
    assert link.rate_bits("1gbit") == 1e9 and link.rate_bits("400mbit") == 4e8
    with pytest.raises(ValueError, match="tc's units"):
        link.rate_bits("fast")


def test_auto_compression_carries_more_than_the_link_for_token_ids():
    rows = link.run(["200mbit"], ["tokens"], seconds=3.0, compression="auto,none")
    auto, plain = (next(r for r in rows if r["compression"] == c) for c in ("auto", "none"))
    assert plain["link_share"] < 1.1 and plain["wire_share"] >= 1.0, plain  # bounded by the link
    # token ids below 32,000 in int64 shrink to a third or less: more than the link's bytes arrive
    assert auto["wire_share"] < 0.6 and auto["link_share"] > 1.4, auto
