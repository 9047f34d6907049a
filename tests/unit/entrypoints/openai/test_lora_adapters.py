"""The server's LoRA registry (entrypoints/openai/lora_adapters.py) and `--lora-modules`
parsing, without a model: vLLM's load / unload answers (status, text, OpenAI's error JSON)
through the routes on a bare app, adapters chosen by `model` or by a `lora` object without a
path, and the flag in both of vLLM's forms, on the command line and in a --config file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from omnistage.configs.lora_modules import LoraModule, parse_lora_module, parse_lora_modules
from omnistage.configs.server import ServerSettings
from omnistage.diffusion.lora_formats import check_adapter
from omnistage.entrypoints.cli.main import parse_args
from omnistage.entrypoints.openai.errors import APIError, install_error_handlers
from omnistage.entrypoints.openai.lora_adapters import LoraAdapters, add_lora_routes
from omnistage.entrypoints.openai.protocol import (ChatCompletionRequest,
                                                   ImageGenerationRequest, LoraBody)

SERVED = "tiny-image"


def peft_file(path: Path, name: str = "a.safetensors") -> Path:
    tensors = {"transformer.blocks.0.to_q.lora_A.weight": torch.randn(2, 8),
               "transformer.blocks.0.to_q.lora_B.weight": torch.randn(8, 2)}
    save_file(tensors, str(path / name))
    return path / name


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "folder").mkdir()
    peft_file(tmp_path / "folder", "pytorch_lora_weights.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    save_file({"blocks.0.weight": torch.randn(4, 4)}, str(tmp_path / "model.safetensors"))
    kohya = tmp_path / "kohya.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(2, 8),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.randn(24, 2)},
              str(kohya))
    return {"a": peft_file(tmp_path), "folder": tmp_path / "folder", "garbage": garbage,
            "weights": tmp_path / "model.safetensors", "kohya": kohya,
            "missing": tmp_path / "none.safetensors"}


# ---- --lora-modules --------------------------------------------------------------------------

def test_lora_modules_in_both_of_vllms_forms() -> None:
    assert parse_lora_module("ink=/loras/ink") == LoraModule("ink", "/loras/ink")
    assert parse_lora_module("a=b=c") == LoraModule("a", "b=c")    # the first = splits
    assert parse_lora_module('{"name": "w", "path": "/w.safetensors", "base_model_name": '
                             '"base"}') == LoraModule("w", "/w.safetensors", "base")
    for bad, says in [("ink", "expected name=path"), ("=/x", "expected name=path"),
                      ("ink=", "expected name=path"), ("{oops", "not valid JSON"),
                      ('{"name": "w"}', "`path` must be"),
                      ('{"name": "w", "path": "/p", "scale": 1}', "unknown keys ['scale']"),
                      ('{"name": "w", "path": "/p", "base_model_name": 3}', "base_model_name")]:
        with pytest.raises(ValueError, match="lora_modules: .*" + says.replace("[", r"\[")
                           .replace("]", r"\]")):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match=r"\['a'\] given more than once"):
        parse_lora_modules(("a=/x", "b=/y", "a=/z"))


def test_the_serve_flag_takes_several_values_and_repeats() -> None:
    args = parse_args(["serve", "--lora-modules", "a=/x", "b=/y", "--port", "8001",
                       "--lora-modules", '{"name": "c", "path": "/z"}'])
    settings = ServerSettings.from_namespace(args)
    assert settings.lora_modules == ("a=/x", "b=/y", '{"name": "c", "path": "/z"}')
    assert parse_lora_modules(settings.lora_modules)[2] == LoraModule("c", "/z")
    assert ServerSettings.from_namespace(parse_args(["serve"])).lora_modules == ()
    with pytest.raises(ValueError, match="lora_modules: 'nope': expected name=path"):
        ServerSettings.from_namespace(parse_args(["serve", "--lora-modules", "nope"]))


def test_the_serve_flag_from_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("lora-modules: [a=/x, b=/y]\n")
    args = parse_args(["serve", "--config", str(config), "--lora-modules", "c=/z"])
    assert ServerSettings.from_namespace(args).lora_modules == ("a=/x", "b=/y", "c=/z")


# ---- the files ---------------------------------------------------------------------------------

def test_check_adapter_reads_the_layouts_and_refuses_the_rest(files: dict[str, Path]) -> None:
    assert check_adapter(files["a"]) == 2
    assert check_adapter(files["folder"]) == 2          # diffusers' file in a folder
    assert check_adapter(files["kohya"]) == 2
    with pytest.raises(ValueError, match="not a safetensors file"):
        check_adapter(files["garbage"])
    with pytest.raises(ValueError, match="blocks.0.weight: not a LoRA weight"):
        check_adapter(files["weights"])
    with pytest.raises(ValueError, match="no such file or folder"):
        check_adapter(files["missing"])
    half = files["a"].parent / "half.safetensors"
    save_file({"transformer.x.lora_A.weight": torch.randn(2, 8)}, str(half))
    with pytest.raises(ValueError, match=r"x: has \['lora_A'\], needs lora_A and lora_B"):
        check_adapter(half)


# ---- the registry ------------------------------------------------------------------------------

def test_load_list_unload_as_vllm_answers(files: dict[str, Path]) -> None:
    loras = LoraAdapters(SERVED, takes_lora=True)
    assert loras.load("ink", str(files["a"])) == "Success: LoRA adapter 'ink' added successfully."
    loras.load("w", str(files["folder"]), base_model_name="other")
    assert [(c.id, c.parent, c.root) for c in loras.cards()] == [
        ("ink", SERVED, str(files["a"])), ("w", "other", str(files["folder"]))]
    assert loras.card("w").parent == "other" and loras.card(SERVED) is None
    for name, path, status, code in [("ink", files["a"], 400, "lora_already_loaded"),
                                     ("x", files["missing"], 404, "lora_not_found"),
                                     ("x", files["garbage"], 400, "invalid_lora"),
                                     ("x", files["weights"], 400, "invalid_lora"),
                                     (SERVED, files["a"], 400, None)]:
        with pytest.raises(APIError) as err:
            loras.load(name, str(path))
        assert (err.value.status, err.value.code) == (status, code), err.value.message
    assert "No adapter found for" in _message(loras.load, "x", str(files["missing"]))
    assert loras.load("ink", str(files["kohya"]), inplace=True).startswith("Success")
    assert loras.loaded["ink"].path == str(files["kohya"])
    assert loras.unload("ink") == "Success: LoRA adapter 'ink' removed successfully."
    with pytest.raises(APIError) as err:
        loras.unload("ink")
    assert err.value.status == 404 and err.value.message == (
        "The lora adapter 'ink' cannot be found.")
    assert [c.id for c in loras.cards()] == ["w"]


def _message(fn, *args: object) -> str:
    with pytest.raises(APIError) as err:
        fn(*args)
    return err.value.message


def test_a_model_without_a_diffusion_stage_takes_none(files: dict[str, Path]) -> None:
    loras = LoraAdapters(SERVED, takes_lora=False)
    with pytest.raises(APIError) as err:
        loras.load("ink", str(files["a"]))
    assert (err.value.status, err.value.code) == (400, "lora_not_supported")
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "lora": {"name": "x"}})
    assert loras.with_adapter(body) is body        # the route decides (refused / ignored)


def test_requests_choose_by_model_or_by_name(files: dict[str, Path]) -> None:
    loras = LoraAdapters(SERVED, takes_lora=True)
    loras.load("ink", str(files["a"]))
    ink = str(files["a"])

    def chosen(**body: object) -> LoraBody | None:
        return loras.with_adapter(ImageGenerationRequest.model_validate(
            {"prompt": "p", **body})).lora

    assert chosen() is None and chosen(model=SERVED) is None
    assert (chosen(model="ink").name, chosen(model="ink").path) == ("ink", ink)
    assert chosen(model="ink").scale == 1.0
    assert chosen(model="ink", lora={"name": "ink", "scale": 0.5}).scale == 0.5
    assert chosen(lora={"lora_name": "ink", "scale": 0.3}).path == ink
    # given with a path: taken as it is, and found by name alone afterwards
    other = str(files["folder"])
    assert chosen(lora={"name": "w", "path": other}).path == other
    assert chosen(lora={"name": "w"}).path == other
    # another file under a loaded name: this request only, under a name of its own at the
    # stage (which holds one adapter per name)
    assert dict(chosen(lora={"name": "ink", "path": other})) == {
        "name": f"ink@{other}", "path": other, "scale": 1.0, "int_id": None}
    assert (chosen(lora={"name": "ink"}).name, chosen(lora={"name": "ink"}).path) == ("ink", ink)
    for body, status, param in [({"model": "nope"}, 404, "model"),
                                ({"lora": {"name": "nope"}}, 400, "lora.name"),
                                ({"model": "ink", "lora": {"name": "w"}}, 400, "lora.name")]:
        with pytest.raises(APIError) as err:
            chosen(**body)
        assert (err.value.status, err.value.param) == (status, param)
    loras.unload("ink")
    with pytest.raises(APIError):
        chosen(model="ink")
    with pytest.raises(APIError):
        chosen(lora={"name": "ink"})           # unloaded: not by name any more
    # loaded again from another file: a request still running with the first one keeps it
    loras.load("ink", other)
    assert (chosen(model="ink").name, chosen(model="ink").path) == (f"ink@{other}", other)
    loras.unload("ink")
    loras.load("ink", ink)
    assert (chosen(model="ink").name, chosen(model="ink").path) == ("ink", ink)


def test_the_routes_answer_in_vllms_and_openais_shapes(files: dict[str, Path]) -> None:
    app = FastAPI()
    install_error_handlers(app)
    add_lora_routes(app, LoraAdapters(SERVED, takes_lora=True), {})
    http = TestClient(app)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "ink",
                                                 "lora_path": str(files["a"])})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'ink' added successfully."
    for path, body, status, param in [
            ("load", {"lora_name": "ink", "lora_path": str(files["a"])}, 400, "lora_name"),
            ("load", {"lora_name": "x", "lora_path": str(files["missing"])}, 404, "lora_path"),
            ("load", {"lora_name": "x", "lora_path": str(files["garbage"])}, 400, "lora_path"),
            ("load", {"lora_name": "x"}, 400, "lora_path"),
            ("load", {"lora_name": "", "lora_path": str(files["a"])}, 400, "lora_name"),
            ("unload", {"lora_name": "x"}, 404, "lora_name"),
            ("unload", {}, 400, "lora_name")]:
        r = http.post(f"/v1/{path}_lora_adapter", json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "ink", "lora_int_id": 1})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ink' removed successfully."
