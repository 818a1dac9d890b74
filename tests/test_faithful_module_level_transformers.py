"""O2/O3 on tiny transformers models (random weights, built from configs): generate() of an
encoder-decoder and a causal LM, a multimodal model's feature methods, BERT with gradient
checkpointing, export, compile, and PEFT LoRA adapters added before or after conversion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from helpers import needs_compile, rel_error
from test_faithful_module_level import LEVELS, _grads, _watch

transformers = pytest.importorskip("transformers")
BF16 = torch.bfloat16
IDS = torch.tensor([[5, 9, 13, 2, 7, 30], [3, 8, 21, 40, 11, 6]])


@pytest.fixture(autouse=True)
def _quiet_slow_dtype_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mixprec.convert.api.warn_if_slow", lambda *a: None)


def _t5() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config).eval()


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _first_logits(model: nn.Module, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            IDS, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
            output_logits=True, **kwargs,
        )  # fmt: skip
    assert out.sequences.shape[1] >= 3
    return out.logits[0].float()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("make", [_t5, _gpt2], ids=["t5", "gpt2"])
def test_generate_computes_low(make: Callable[[], nn.Module], level: str) -> None:
    model = make()
    converted = amp.auto_mixed_precision(model, level, BF16)
    seen = _watch(converted)
    logits = _first_logits(converted)
    assert seen
    assert all(dtypes == {BF16} for dtypes in seen.values()), seen
    assert rel_error(logits, _first_logits(model)) < 3e-2


@pytest.mark.parametrize("level", LEVELS)
def test_clip_feature_methods_compute_low(level: str) -> None:
    torch.manual_seed(0)
    text = {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1,
    }  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "image_size": 16, "patch_size": 8,
    }  # fmt: skip
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = transformers.CLIPModel(config).eval()
    converted = amp.auto_mixed_precision(model, level, BF16)
    seen = _watch(converted, weights=False)  # the projections are called from outside
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        for method, kwargs in [
            ("get_text_features", {"input_ids": IDS}),
            ("get_image_features", {"pixel_values": pixels}),
        ]:
            ours = getattr(converted, method)(**kwargs).pooler_output
            reference = getattr(model, method)(**kwargs).pooler_output
            assert ours.dtype == BF16  # a method other than forward: left as computed
            assert rel_error(ours, reference) < 3e-2
    assert {"text_projection", "visual_projection"} <= set(seen)
    assert all(dtypes == {BF16} for dtypes in seen.values()), seen


@pytest.mark.parametrize("level", LEVELS)
def test_bert_gradient_checkpointing_trains_like_without(level: str) -> None:
    grads = []
    for checkpointing in (True, False):
        model = _bert().train()
        model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        converted = amp.auto_mixed_precision(model, level, BF16)
        for _ in range(2):
            converted(input_ids=IDS, labels=torch.tensor([0, 1])).loss.backward()
        grads.append(_grads(model))
    for ours, ref in zip(*grads, strict=True):
        assert ours.dtype == torch.float32
        assert torch.equal(ours, ref)


def test_gpt2_exports_and_matches_eager() -> None:
    model = _gpt2()
    model.config.use_cache = False
    converted = amp.auto_mixed_precision(model, "O2", BF16)
    with torch.no_grad():
        expected = converted(input_ids=IDS).logits
    exported = torch.export.export(converted, (), {"input_ids": IDS})
    out = exported.module()(input_ids=IDS).logits
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


@needs_compile
def test_bert_compiles_without_graph_breaks() -> None:
    converted = amp.auto_mixed_precision(_bert().eval(), "O2", BF16)
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(converted)(input_ids=IDS)
        assert explanation.graph_break_count == 0
        compiled = torch.compile(converted, backend="eager")
        assert torch.equal(compiled(input_ids=IDS).logits, converted(input_ids=IDS).logits)


@pytest.mark.parametrize("when", ["before", "after"])
def test_peft_lora_before_or_after_conversion(when: str) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["query", "value"], lora_dropout=0.0)
    model = _bert().eval()
    if when == "before":
        model = peft.get_peft_model(model, config)
        converted = amp.auto_mixed_precision(model, "O2", BF16)
    else:
        converted = peft.get_peft_model(amp.auto_mixed_precision(model, "O2", BF16), config)
        model = peft.get_peft_model(_bert().eval(), config)
    for name, p in model.named_parameters():  # a non-zero adapter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    if when == "after":
        converted.load_state_dict(model.state_dict())
    seen = _watch(converted)
    out = converted(input_ids=IDS).logits
    assert out.dtype == torch.float32
    assert rel_error(out, model(input_ids=IDS).logits) < 3e-2
    base = [n for n in seen if n.endswith("query.base_layer")]
    assert base
    assert seen[base[0]] == {BF16}
    lora_a = next(n for n in seen if "query.lora_A" in n)
    # an adapter computes low, converted with the model or added to it after conversion
    # (converted as it is registered, as conversion would have converted it there)
    assert seen[lora_a] == {BF16}
    out.sum().backward()
    lora = [p for n, p in converted.named_parameters() if "lora_A" in n]
    assert lora
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora)
