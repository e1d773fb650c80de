"""The kernel micro-benchmark's options (`python -m speculant.kernels.bench`): bad values are
refused by name before anything is timed."""
import pytest

from speculant.kernels.bench import BenchConfig


@pytest.mark.parametrize("options, name", [
    ({"ms": "0,4"}, "--ms"),
    ({"copies": 0}, "--copies"),
    ({"budget": 0.0}, "--budget"),
    ({"kv_dtype": "int8"}, "--kv_dtype"),
    ({"block_size": -16}, "--block_size"),
    ({"kv_dtype": "bfloat16", "block_size": 16}, "--block_size 16 with --kv_dtype bfloat16"),
])
def test_bad_options_are_refused_by_name(options, name):
    with pytest.raises(ValueError, match=name):
        BenchConfig(**options)


def test_row_counts_and_copies_are_read():
    cfg = BenchConfig(ms="1,16,17", copies=30)
    assert cfg.row_counts == [1, 16, 17] and cfg.copies == 30


def test_the_cache_block_size_defaults_to_what_its_dtype_needs():
    """0 (the default) takes the cache's own block size: 32 for the bfloat16 tiles' layout (16
    was refused by the attention kernel after the linears had been timed), 16 otherwise; a size
    given is kept."""
    assert BenchConfig(kv_dtype="bfloat16").block_size == 32
    assert BenchConfig(kv_dtype="float16").block_size == 16
    assert BenchConfig(kv_dtype="bfloat16", block_size=64).block_size == 64
