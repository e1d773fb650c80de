"""The kernel micro-benchmark's options (`python -m speculant.kernels.bench`): bad values are
refused by name before anything is timed."""
import pytest

from speculant.kernels.bench import BenchConfig


@pytest.mark.parametrize("options, name", [
    ({"ms": "0,4"}, "--ms"),
    ({"copies": 0}, "--copies"),
    ({"budget": 0.0}, "--budget"),
    ({"kv_dtype": "int8"}, "--kv_dtype"),
])
def test_bad_options_are_refused_by_name(options, name):
    with pytest.raises(ValueError, match=name):
        BenchConfig(**options)


def test_row_counts_and_copies_are_read():
    cfg = BenchConfig(ms="1,16,17", copies=30)
    assert cfg.row_counts == [1, 16, 17] and cfg.copies == 30
