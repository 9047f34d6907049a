"""DigitsDiT, the built-in demo model: the shipped weights draw digits that a classifier fitted
on the real ones recognises; prompts parse to one digit; loading is strict and exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.svm import SVC
from torch import Tensor, nn

from omnistage.models.digits_dit import (DigitsDiT, DigitsDiTConfig, parse_digit, sample,
                                         to_pil)

PER_DIGIT = 50


@pytest.fixture(scope="module")
def shipped() -> DigitsDiT:
    return DigitsDiT.from_pretrained()


@pytest.fixture
def tiny_dit(tmp_path: Path) -> Path:
    """A two-layer model with random weights everywhere (adaLN-Zero would otherwise make its
    output exactly zero), saved the way the shipped one is."""
    torch.manual_seed(0)
    model = DigitsDiT(DigitsDiTConfig(hidden_size=32, num_layers=2, num_heads=2))
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    model.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def real_digits() -> tuple[Tensor, Tensor]:
    """(1797, 64) pixels in [-1, 1], the scaling the model was trained on, and labels."""
    digits = load_digits()
    return (torch.tensor(digits.data, dtype=torch.float32) / 8.0 - 1.0,
            torch.tensor(digits.target))


def test_shipped_weights_draw_the_digit_asked_for(shipped: DigitsDiT) -> None:
    pixels, labels = real_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        pixels.numpy(), labels.numpy(), test_size=0.25, stratify=labels.numpy(), random_state=0)
    classifier = SVC().fit(x_train, y_train)
    assert classifier.score(x_test, y_test) > 0.95   # the judge itself reads real digits well

    asked = torch.arange(10).repeat_interleave(PER_DIGIT)                 # (500,)
    images = sample(shipped, asked, generator=torch.Generator().manual_seed(0))
    assert images.shape == (500, 1, 8, 8)
    assert images.min() >= -1 and images.max() <= 1
    predicted = torch.from_numpy(classifier.predict(images.flatten(1).numpy()))
    accuracy = (predicted == asked).float().mean().item()
    assert accuracy >= 0.95, f"only {accuracy:.1%} of generated digits recognised"

    # not one template per digit: samples of a digit vary about as much as real ones do
    def spread(x: Tensor, y: Tensor) -> float:
        return torch.stack([x[y == d].std(0).mean() for d in range(10)]).mean().item()
    assert spread(images.flatten(1), asked) > 0.5 * spread(pixels, labels)


@pytest.mark.parametrize("prompt, digit", [
    ("a handwritten 7", 7), ("7", 7), ("seven", 7), ("Seven!", 7), ("the digit nine", 9),
    ("zero", 0), ("ONE", 1), ("a 3, a three", 3), ("draw 0.", 0), ("eight-ish", 8),
])
def test_parse_digit(prompt: str, digit: int) -> None:
    assert parse_digit(prompt) == digit


@pytest.mark.parametrize("prompt", ["a cat", "", "someone", "tone", "often", "17", "7th",
                                    "digit_7", "fourteen"])
def test_parse_digit_rejects_prompts_naming_no_digit(prompt: str) -> None:
    with pytest.raises(ValueError, match=r"prompt names no digit \(0-9 or zero\.\.nine\)"):
        parse_digit(prompt)


@pytest.mark.parametrize("prompt", ["3 or 5", "one and two", "a 4 next to a nine"])
def test_parse_digit_rejects_two_different_digits(prompt: str) -> None:
    with pytest.raises(ValueError, match="more than one digit"):
        parse_digit(prompt)


def test_forward_shape(tiny_dit: Path) -> None:
    model = DigitsDiT.from_pretrained(tiny_dit)
    v = model(torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([0, 9, model.null_label]))
    assert v.shape == (3, 1, 8, 8)


def test_round_trip_gives_identical_outputs(tiny_dit: Path, tmp_path: Path) -> None:
    model = DigitsDiT.from_pretrained(tiny_dit)
    model.save_pretrained(tmp_path / "again")
    again = DigitsDiT.from_pretrained(tmp_path / "again")
    assert again.config == model.config
    x, t, labels = torch.randn(4, 1, 8, 8), torch.rand(4), torch.tensor([1, 2, 3, 10])
    with torch.no_grad():
        assert torch.equal(model(x, t, labels), again(x, t, labels))
    assert model(x, t, labels).abs().max() > 0   # random adaLN: a real, non-zero output


def test_config_json_round_trip(shipped: DigitsDiT) -> None:
    assert DigitsDiTConfig.from_json(shipped.config.to_json()) == shipped.config
    assert not shipped.training


def test_mis_shaped_tensor_is_named(tiny_dit: Path) -> None:
    tensors = load_file(tiny_dit / "model.safetensors")
    tensors["blocks.1.attn.qkv.weight"] = torch.zeros(96, 16)
    save_file(tensors, tiny_dit / "model.safetensors")
    with pytest.raises(ValueError, match=r"'blocks\.1\.attn\.qkv\.weight' has shape \(96, 16\), "
                                         r"the model expects \(96, 32\)"):
        DigitsDiT.from_pretrained(tiny_dit)


def test_missing_and_unexpected_tensors_are_named(tiny_dit: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_dit, tmp_path / "extra")
    tensors = load_file(tiny_dit / "model.safetensors")
    del tensors["final.linear.bias"]
    save_file(tensors, tiny_dit / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: final\.linear\.bias"):
        DigitsDiT.from_pretrained(tiny_dit)

    tensors = load_file(tmp_path / "extra" / "model.safetensors")
    tensors["head.weight"] = torch.zeros(1)
    save_file(tensors, tmp_path / "extra" / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensors: head\.weight"):
        DigitsDiT.from_pretrained(tmp_path / "extra")


def test_bad_config_and_missing_files(tiny_dit: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_dit / "config.json").read_text())
    (tiny_dit / "config.json").write_text(json.dumps({**config, "hidden_dim": 64}))
    with pytest.raises(ValueError, match=r"unknown keys \['hidden_dim'\]"):
        DigitsDiT.from_pretrained(tiny_dit)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DigitsDiT.from_pretrained(tmp_path)


def test_sampling_is_deterministic_with_a_generator(tiny_dit: Path) -> None:
    model = DigitsDiT.from_pretrained(tiny_dit)
    labels = torch.tensor([0, 5, 9])

    def draw(seed: int) -> Tensor:
        return sample(model, labels, num_steps=4, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))


def test_to_pil(shipped: DigitsDiT) -> None:
    pytest.importorskip("PIL")
    images = sample(shipped, torch.tensor([3, 8]), num_steps=4,
                    generator=torch.Generator().manual_seed(0))
    pils = to_pil(images, scale=4)
    assert [(p.mode, p.size) for p in pils] == [("L", (32, 32))] * 2
    assert pils[0].getpixel((0, 0)) == round((images[0, 0, 0, 0].item() + 1) * 127.5)
