"""O1 and the autocast level keep the user's model: modes, hooks, entry points, state,
parametrizations, fast paths, export/compile, the rest of nn.Module's surface."""

from __future__ import annotations

import copy
import pickle
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec as amp
from helpers import count_casts, needs_compile, rel_error

LEVELS = ["O1", "autocast"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"bf16": 3e-2, "fp16": 5e-3}

every = pytest.mark.parametrize(
    ("level", "dtype"), [(lv, d) for lv in LEVELS for d in DTYPES], ids=lambda v: str(v)
)


class Net(nn.Module):
    """A Linear, a dropout, an `if self.training:` branch and a helper method."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.drop = nn.Dropout(0.5)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.encode(x))
        if self.training:
            h = h * 0.0 + h  # the same value through another op
        return self.fc2(h)


def _convert(model: nn.Module, level: str, dtype: str) -> nn.Module:
    return amp.auto_mixed_precision(model, level, dtype)


@every
def test_train_and_eval_take_effect(level: str, dtype: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    for start in (True, False):
        model = Net().train(start)
        converted = _convert(model, level, dtype)
        converted.eval()
        assert torch.equal(converted(x), converted(x))  # no dropout in eval
        assert rel_error(converted(x).float(), model.eval()(x)) < TOL[dtype]
        converted.train()
        a, b = converted(x), converted(x)
        assert not torch.equal(a, b)  # dropout is back on


@every
def test_hooks_fire_on_every_call_with_real_tensors(level: str, dtype: str) -> None:
    model = Net().eval()
    seen: list[str] = []
    model.fc1.register_forward_hook(lambda m, a, o: seen.append(f"before:{o.dtype}"))
    converted = _convert(model, level, dtype)
    converted.fc2.register_forward_pre_hook(lambda m, a: seen.append(f"pre:{type(a[0]).__name__}"))
    converted.fc1.register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
    x = torch.randn(2, 8, requires_grad=True)
    for _ in range(2):
        converted(x).sum().backward()
    low = str(DTYPES[dtype])
    assert seen.count(f"before:{low}") == 2  # the white-list Linear computed low
    assert seen.count("pre:Tensor") == 2
    assert seen.count("backward") == 2


@every
def test_every_entry_point_computes_low(level: str, dtype: str) -> None:
    model = Net().eval()
    converted = _convert(model, level, dtype)
    x = torch.randn(2, 8)
    encoded = converted.encode(x)  # another method of the class
    assert encoded.dtype in (DTYPES[dtype], torch.float32)
    assert rel_error(encoded.float(), model.encode(x)) < TOL[dtype]
    out = converted.fc1(x)  # a white-list layer called directly answers as inside the model
    assert out.dtype == (torch.float32 if level == "O1" else DTYPES[dtype])  # O1: cast back
    assert torch.equal(out, out.to(DTYPES[dtype]).to(out.dtype))  # computed in the low dtype
    with pytest.raises(AttributeError):
        converted.missing_method  # noqa: B018


@pytest.mark.parametrize("reentrant", [True, False])
@every
def test_activation_checkpointing(level: str, dtype: str, reentrant: bool) -> None:
    model = Net().eval()
    converted = _convert(model, level, dtype)
    x = torch.randn(2, 8, requires_grad=True)
    converted(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    checkpoint(converted, x, use_reentrant=reentrant).sum().backward()
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)


class Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Reverse.apply(self.fc(x))


@every
def test_custom_autograd_function_keeps_its_backward(level: str, dtype: str) -> None:
    model = WithFunction()
    converted = _convert(model, level, dtype)
    x = torch.randn(2, 4)
    converted(x).float().sum().backward()
    converted_grad = model.fc.bias.grad.clone()
    torch.testing.assert_close(converted_grad, -torch.full((4,), 2.0), rtol=0, atol=0)


@every
def test_state_writes_are_what_the_next_forward_uses(level: str, dtype: str) -> None:
    model = Net().eval()
    converted = _convert(model, level, dtype)
    x = torch.randn(2, 8)
    before = converted(x)
    with torch.no_grad():
        model.fc2.bias.data += 1.0  # a .data write on the original's shared Parameter
    assert rel_error(converted(x) - 1.0, before) < TOL[dtype]
    state = {k: torch.zeros_like(v) for k, v in converted.state_dict().items()}
    converted.load_state_dict(state)
    assert torch.count_nonzero(converted(x)) == 0
    assert list(converted.state_dict()) == list(Net().state_dict())


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


@every
def test_parametrizations_run(level: str, dtype: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", Symmetric())
    converted = _convert(model, level, dtype)
    x = torch.randn(2, 4)
    assert rel_error(converted(x).float(), model(x)) < TOL[dtype]


@pytest.mark.parametrize("level", LEVELS)
def test_transformer_encoder_fast_path_keeps_its_meaning(level: str) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    converted = _convert(encoder, level, "bf16")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        expected = encoder(x, src_key_padding_mask=mask)
        out = converted(x, src_key_padding_mask=mask)
    assert torch.equal(out[1, 3:], torch.zeros_like(out[1, 3:]))  # padded positions
    assert rel_error(out.float(), expected) < 3e-2
    assert "fast path" in amp.explain(converted).runtime()[""]


@every
def test_the_rest_of_the_module_surface(level: str, dtype: str) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    converted = _convert(model, level, dtype)
    x = torch.randn(2, 8)
    expected = converted(x)
    for other in (copy.deepcopy(converted), pickle.loads(pickle.dumps(converted))):
        assert torch.equal(other(x), expected)
    params = {k: v * 2 for k, v in converted.named_parameters()}
    doubled = torch.func.functional_call(converted, params, (x,))
    assert not torch.equal(doubled, expected)
    converted.requires_grad_(False)
    assert not converted(x).requires_grad
    wide = copy.deepcopy(converted).to(torch.float64)
    assert wide(x.double()).dtype == torch.float64  # float64 is never cast down


@pytest.mark.parametrize("level", LEVELS)
def test_two_threads_get_the_serial_results(level: str) -> None:
    torch.manual_seed(0)
    converted = _convert(Net().eval(), level, "bf16")
    inputs = [torch.randn(2, 8) for _ in range(4)]
    serial = [converted(x) for x in inputs]
    failures: list[str] = []

    def run() -> None:
        for i in range(200):
            if not torch.equal(converted(inputs[i % 4]), serial[i % 4]):
                failures.append(f"call {i}")

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_converting_patches_nothing_another_thread_sees() -> None:
    errors: list[BaseException] = []
    stop = threading.Event()
    other = nn.Linear(4, 4)

    def busy() -> None:
        try:
            while not stop.is_set():
                with torch.no_grad():
                    other(torch.randn(1, 4))
        except BaseException as error:
            errors.append(error)

    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    thread = threading.Thread(target=busy)
    thread.start()
    try:
        for _ in range(5):
            _convert(Net(), "O1", "bf16")
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert nn.Module.__call__ is call
    assert nn.Module.__getattr__ is getattr_


@pytest.mark.parametrize("when", ["before", "after"])
def test_peft_lora_adapters(when: str) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, target_modules=["fc1"], lora_alpha=4, init_lora_weights=False)
    x = torch.randn(2, 8)
    if when == "before":
        model = peft.get_peft_model(Net().eval(), config)
        converted = _convert(model, "O1", "bf16")
        assert rel_error(converted(x), model(x)) < 3e-2
    else:
        base = Net().eval()
        converted = _convert(base, "O1", "bf16")
        model = peft.get_peft_model(converted, config)
        reference = peft.get_peft_model(copy.deepcopy(Net()).eval(), config)
        reference.load_state_dict(model.state_dict())
        assert rel_error(model(x), reference(x)) < 3e-2


# ---------------------------------------------------------------- transformers models

transformers = pytest.importorskip("transformers")


def _bert(dropout: float = 0.1) -> nn.Module:
    config = transformers.BertConfig(
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return transformers.BertModel(config).eval()


IDS = torch.randint(2, 100, (2, 8), generator=torch.Generator().manual_seed(0))


@needs_compile
def test_bert_exports_and_compiles_without_a_break_per_op() -> None:
    torch.manual_seed(0)  # O1 only: one export and one dynamo trace cost ~45 s here
    converted = _convert(_bert(), "O1", "bf16")
    with torch.no_grad():
        expected = converted(input_ids=IDS).last_hidden_state
        exported = torch.export.export(converted, (), {"input_ids": IDS})
        assert torch.equal(exported.module()(input_ids=IDS).last_hidden_state, expected)
        torch._dynamo.reset()
        report = torch._dynamo.explain(converted)(input_ids=IDS)
    assert report.graph_break_count == 0


@pytest.mark.parametrize("level", LEVELS)
def test_bert_gradient_checkpointing_trains_in_low_precision(level: str) -> None:
    torch.manual_seed(0)
    model = _bert(dropout=0.0)
    converted = _convert(model, level, "bf16").train()
    converted.gradient_checkpointing_enable()
    converted(input_ids=IDS).last_hidden_state.float().sum().backward()
    with_checkpoint = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    converted.gradient_checkpointing_disable()
    converted(input_ids=IDS).last_hidden_state.float().sum().backward()
    assert with_checkpoint
    for name, p in model.named_parameters():
        if name in with_checkpoint:
            torch.testing.assert_close(p.grad, with_checkpoint[name], rtol=1e-2, atol=1e-3)


def test_gpt2_and_t5_generate() -> None:
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32, use_cache=False
        )
    ).eval()
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=100,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).eval()
    for model in (gpt2, t5):
        converted = _convert(model, "O1", "bf16")
        out = converted.generate(IDS, max_new_tokens=3, do_sample=False)
        ref = model.generate(IDS, max_new_tokens=3, do_sample=False)
        assert out.shape == ref.shape
    with torch.no_grad():
        logits, counter = count_casts(lambda: converted(IDS, decoder_input_ids=IDS[:, :2]).logits)
    assert logits.dtype == torch.float32
    assert counter.casts[(torch.float32, torch.bfloat16)] > 0


def test_clip_feature_methods() -> None:
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config={
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 16,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 16,
            "patch_size": 8,
        },
        projection_dim=16,
    )
    model = transformers.CLIPModel(config).eval()
    converted = _convert(model, "O1", "bf16")
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        for method, arg in (("get_text_features", IDS), ("get_image_features", pixels)):
            ours = getattr(converted, method)(arg)
            theirs = getattr(model, method)(arg)
            ours = getattr(ours, "pooler_output", ours)
            theirs = getattr(theirs, "pooler_output", theirs)
            assert rel_error(ours.float(), theirs) < 3e-2, method
