"""transformers architectures at each level: forward with labels, backward, ``generate()``.

Tiny random configs (2 layers, width 16, vocabulary 64); prints, per model and level, the
converted model's loss next to the float32 model's, or the error. At O1 it also runs the
model with the white list applied by the torch-function mode (the path under
``torch.compile``) and says whether that loss is bit-identical to the kernels'. A check, not
a timing.

Run: python benchmarks/zoo_check.py [--levels O1,autocast,O2,O3]
"""

# mypy: ignore-errors
import argparse
import warnings

import torch
import transformers as tf

import mixprec as amp
from mixprec.convert.structure import forward_of

warnings.filterwarnings("ignore")
torch.manual_seed(0)
ids = torch.randint(0, 64, (2, 8))
small = {
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 32,
}
cfgs = {
    "llama": (tf.LlamaConfig(**small, num_key_value_heads=2), tf.LlamaForCausalLM),
    "mistral": (tf.MistralConfig(**small, num_key_value_heads=2), tf.MistralForCausalLM),
    "qwen2": (tf.Qwen2Config(**small, num_key_value_heads=2), tf.Qwen2ForCausalLM),
    "gptneo": (
        tf.GPTNeoConfig(
            vocab_size=64,
            hidden_size=16,
            num_layers=2,
            num_heads=2,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=32,
        ),
        tf.GPTNeoForCausalLM,
    ),
    "opt": (
        tf.OPTConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            ffn_dim=32,
            max_position_embeddings=32,
            word_embed_proj_dim=16,
        ),
        tf.OPTForCausalLM,
    ),
    "bart": (
        tf.BartConfig(
            vocab_size=64,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=32,
        ),
        tf.BartForConditionalGeneration,
    ),
    "roberta": (tf.RobertaConfig(**small), tf.RobertaForMaskedLM),
    "distilbert": (
        tf.DistilBertConfig(
            vocab_size=64, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32
        ),
        tf.DistilBertForMaskedLM,
    ),
    "albert": (
        tf.AlbertConfig(
            vocab_size=64,
            embedding_size=8,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        ),
        tf.AlbertForMaskedLM,
    ),
    "deberta": (tf.DebertaV2Config(**small), tf.DebertaV2ForMaskedLM),
    "electra": (
        tf.ElectraConfig(
            vocab_size=64,
            embedding_size=16,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        ),
        tf.ElectraForMaskedLM,
    ),
    "falcon": (
        tf.FalconConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2),
        tf.FalconForCausalLM,
    ),
    "gptj": (
        tf.GPTJConfig(vocab_size=64, n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=32),
        tf.GPTJForCausalLM,
    ),
    "bloom": (
        tf.BloomConfig(vocab_size=64, hidden_size=16, n_layer=2, n_head=2),
        tf.BloomForCausalLM,
    ),
    "mpt": (
        tf.MptConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=32),
        tf.MptForCausalLM,
    ),
}


def main() -> None:
    """Print one line per model and level."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="O2,O3")
    levels = parser.parse_args().levels.split(",")
    for name, (cfg, cls) in cfgs.items():
        check(name, cfg, cls, levels)


def _mode_loss(conv, kw):
    """The loss with O1's list applied by the mode instead of the kernels."""
    region = next(forward_of(m).region for m in conv.modules() if hasattr(forward_of(m), "region"))
    region.kernels = False
    try:
        torch.manual_seed(1)  # (the same dropout masks as the kernels' call)
        return conv(**kw).loss
    finally:
        region.kernels = True


def check(name, cfg, cls, levels):
    """Convert one model at each level and run it (forward, backward, generate)."""
    for level in levels:
        try:
            model = cls(cfg)
            kw = {"input_ids": ids, "labels": ids}
            if name == "bart":
                kw["decoder_input_ids"] = ids
            ref = model(**kw).loss
            conv = amp.auto_mixed_precision(model, level, torch.bfloat16)
            torch.manual_seed(1)
            out = conv(**kw)
            out.loss.backward()
            if "CausalLM" in cls.__name__:
                conv.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
            same = ""
            if level == "O1":
                same = f" mode-identical {torch.equal(_mode_loss(conv, kw), out.loss)}"
            print(
                f"{name:10s} {level} ok loss {out.loss.item():.4f} ref {ref.item():.4f} "
                f"dtype {out.loss.dtype}{same}"
            )
        except Exception as e:
            print(f"{name:10s} {level} FAIL {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
