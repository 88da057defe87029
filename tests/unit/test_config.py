"""Budget parsing: bytes, units, percentages and the errors for bad strings."""

import pytest

from moetier.config import format_bytes, parse_budget
from moetier.errors import ConfigError

TOTAL = 1000 * 1024**2


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (None, TOTAL),
        ("all", TOTAL),
        ("25%", TOTAL // 4),
        ("12.5%", TOTAL // 8),
        ("0%", 0),
        ("6GiB", 6 * 1024**3),
        ("6 GiB", 6 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("1.5MiB", int(1.5 * 1024**2)),
        ("100", 100),
        ("100B", 100),
        (4096, 4096),
    ],
)
def test_parse_budget(budget: object, expected: int) -> None:
    assert parse_budget(budget, TOTAL) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-5GiB", "150%", 0.25, -1, True])
def test_parse_budget_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="budget"):
        parse_budget(bad, TOTAL, "expert budget")  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"


def test_prefix_caching_switch_must_be_a_bool() -> None:
    from moetier.config import CacheConfig

    assert CacheConfig().enable_prefix_caching is True
    with pytest.raises(ConfigError, match="enable_prefix_caching must be True or False"):
        CacheConfig(enable_prefix_caching="no")  # type: ignore[arg-type]


def test_transfer_window_must_be_positive() -> None:
    from moetier.config import OffloadConfig

    assert OffloadConfig().transfer_window == 1
    with pytest.raises(ConfigError, match="transfer_window"):
        OffloadConfig(transfer_window=0)
