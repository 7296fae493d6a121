"""topology.sizes: one meaning of a size (K/M/G/T: powers of 1024) for settings, configs
and messages."""
from __future__ import annotations

import re

import pytest

from topology.sizes import format_size, parse_size

SAME = {"1MB": 1 << 20, "1MiB": 1 << 20, "1M": 1 << 20, "1mb": 1 << 20, "1048576": 1 << 20,
        "64K": 64 << 10, "64KB": 64 << 10, "64KiB": 64 << 10, "2G": 2 << 30, "2GB": 2 << 30}


def test_parse_size():
    for text, expected in SAME.items():
        assert parse_size(text) == expected
    assert parse_size("80GiB") == parse_size("80GB") == parse_size("80g") == 80 << 30
    assert parse_size("2T") == 2 << 40
    assert parse_size("1.5KiB") == 1536
    assert parse_size(" 4096 ") == parse_size("4096B") == 4096
    assert parse_size("0", zero=True) == 0
    for bad in ("0", "-1G", "80 parsecs", "", "G", "1.2.3M"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_size(bad)


def test_format_size():
    assert [format_size(n) for n in (0, 512, 1 << 10, 1536, 64 << 10, 1023 << 20, 24.1 * (1 << 30),
                                     2 << 40)] == \
        ["0 bytes", "512 bytes", "1 KiB", "1.5 KiB", "64 KiB", "1023 MiB", "24.1 GiB", "2 TiB"]
    for n in (1 << 10, 1536, 64 << 10, 3 << 30):
        assert parse_size(format_size(n).replace(" ", "")) == n


def test_settings_and_configs_read_sizes_alike():
    from embedding.train.config import parse_config
    from neocomm.config import get

    assert get("STAGING_BYTES", {"NEOCOMM_STAGING_BYTES": "1MB"}) == 1 << 20
    assert get("STAGING_BYTES", {"NEOCOMM_STAGING_BYTES": "1M"}) == 1 << 20
    cfg = parse_config({"plan": {"memory": "1MB", "host_memory": "1MiB"}})
    assert parse_size(cfg.plan.memory) == parse_size(cfg.plan.host_memory) == 1 << 20
