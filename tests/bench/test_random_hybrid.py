"""The random hybrid used to benchmark checkpoint modes: it loads, tokenizes like the default
model and runs speculation in both modes with output equal to plain decoding."""
import pytest

from speculant.bench.random_hybrid import hybrid_config, write_random_hybrid
from speculant.engine.sampling_params import SamplingParams, SpecParams


def test_default_shape_is_the_default_models():
    cfg = hybrid_config("qwen3_next")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)
    assert cfg.layer_types.count("full_attention") == 7
    lfm = hybrid_config("lfm2")
    assert lfm.layer_types.count("full_attention") == 10
    with pytest.raises(ValueError, match="--arch must be one of"):
        hybrid_config("mamba2")


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2"])
def test_small_random_hybrid_runs_both_modes(arch, tmp_path):
    """The written folder loads with the default model's tokenizer; in both checkpoint modes
    synthetic drafts are accepted (the bench's workload; their text is filler by design) and
    suffix drafts give the plain output."""
    from tokenizers import Tokenizer

    from speculant.engine.config import EngineConfig
    from speculant.engine.engine import Engine
    from speculant.models.loader import default_model_path
    from speculant.models.tokenizer import gguf_tokenizer_folder

    folder = str(tmp_path / arch)
    write_random_hybrid(arch, folder, num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2)
    prompt = "def add(a, b):\n    return a + b\n"
    default_tok = Tokenizer.from_file(gguf_tokenizer_folder(default_model_path()) + "/tokenizer.json")
    for mode in ("per_step", "reeval"):
        engine = Engine(EngineConfig(model=folder, dtype="float32", spec_type=["synthetic", "suffix"],
                                     spec_options={"synthetic": {"rates": [0.8]}},
                                     spec_ckpt_mode=mode, num_threads=1))
        assert engine.tokenizer.encode(prompt) == default_tok.encode(prompt).ids

        def run(spec):
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, spec=spec)
            return engine.run_to_completion([prompt], params)[0]

        synthetic = run(SpecParams(types=["synthetic"]))
        assert synthetic.spec.num_accepted_tokens > 0 and synthetic.num_generated == 24
        plain = run(SpecParams(enabled=False))
        assert run(SpecParams(types=["suffix"])).output_ids == plain.output_ids
