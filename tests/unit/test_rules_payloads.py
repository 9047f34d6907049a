"""Issue 39.1's rules, on the source: the connector's tensor keys are spelled in one module
(omnistage/payloads.py), and a failure travels as one typed field (`error: StageError | None`),
never as text. Each checker is also run on a snippet that breaks it, so it is not vacuous."""

from __future__ import annotations

import ast
from pathlib import Path

import omnistage
from omnistage import payloads

PACKAGE = Path(omnistage.__file__).parent
# every key and key prefix the payloads module spells (its upper-case string constants)
KEYS = {v for k, v in vars(payloads).items() if k.isupper() and isinstance(v, str)}
PREFIXES = {k for k in KEYS if k.endswith(".")}
# the modules that build or read what crosses an edge or reaches a client: any key literal
# in them is a key spelled outside payloads.py
PAYLOAD_MODULES = [*sorted((PACKAGE / "stages").glob("*.py")),
                   *sorted((PACKAGE / "generation").glob("*.py")),
                   PACKAGE / "outputs.py", PACKAGE / "engine" / "orchestrator.py",
                   PACKAGE / "diffusion" / "image_input.py",
                   PACKAGE / "diffusion" / "pipelines" / "glm_image.py",
                   *sorted((PACKAGE / "testing").glob("toy_*.py"))]
# everywhere else (models/ and the diffusion pipelines name their own tensors): no key read
# from an output's `tensors` / `delta_tensors`
RAW_VIEW_SCOPE = [p for p in sorted(PACKAGE.rglob("*.py"))
                  if p.name != "payloads.py" and p.relative_to(PACKAGE).parts[0]
                  not in ("models", "diffusion")]
# the same words naming something that is no tensor key: (module, key) -> what it names
NOT_TENSOR_KEYS = {
    ("stages/qwen3_tts.py", "'sample_rate'"): "the speech API's ref_audio JSON field",
    ("stages/qwen3_tts.py", "'speaker'"): "a SpeechRequest field",
    ("outputs.py", "'num_prompt_tokens'"): "RequestMetrics.as_dict's field",
}
ERROR_SCOPE = [*(p for floor in ("ar", "diffusion", "generation", "stages", "engine")
                 for p in sorted((PACKAGE / floor).rglob("*.py"))),
               PACKAGE / "outputs.py", PACKAGE / "errors.py"]


def _is_key(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in KEYS or any(node.value.startswith(p) for p in PREFIXES)
    if isinstance(node, ast.JoinedStr) and node.values:     # f"hidden.{layer}"
        return _is_key(node.values[0])
    return False


def _key_uses(tree: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(the object, the key) of each subscript, .get/.pop/.setdefault, dict-literal key and
    `in` test whose key is a payload key."""
    found: list[tuple[ast.AST, ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_key(node.slice):
            found.append((node.value, node.slice))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and node.args
              and _is_key(node.args[0])):
            found.append((node.func.value, node.args[0]))
        elif isinstance(node, ast.Dict):
            found += [(node, k) for k in node.keys if k is not None and _is_key(k)]
        elif (isinstance(node, ast.Compare) and _is_key(node.left)
              and isinstance(node.ops[0], (ast.In, ast.NotIn))):
            found.append((node.comparators[0], node.left))
        elif isinstance(node, ast.DictComp) and _is_key(node.key):
            found.append((node, node.key))
    return found


def _names_tensors(obj: ast.AST) -> bool:
    name = obj.attr if isinstance(obj, ast.Attribute) else getattr(obj, "id", "")
    return name.endswith("tensors")


def key_literals(source: str, path: str, raw_view_only: bool = False) -> list[str]:
    tree = ast.parse(source, path)
    return [f"{path}:{key.lineno} {ast.unparse(key)}" for obj, key in _key_uses(tree)
            if not raw_view_only or _names_tensors(obj)]


def error_text_fields(source: str, path: str) -> list[str]:
    """Annotated class fields named error* typed as text (or the old duplicates
    `invalid_input` / `error_info`) on any class: messages, results, outputs."""
    bad = []
    for cls in ast.walk(ast.parse(source, path)):
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            name, annotation = stmt.target.id, ast.unparse(stmt.annotation)
            if name in ("invalid_input", "error_info") or (
                    name.startswith("error") and "str" in annotation.replace("StageError", "")):
                bad.append(f"{path}:{stmt.lineno} {cls.name}.{name}: {annotation}")
    return bad


def test_tensor_keys_live_in_the_payloads_module() -> None:
    bad = [hit for path in PAYLOAD_MODULES
           for hit in key_literals(path.read_text(), str(path.relative_to(PACKAGE)))
           if (hit.split(":")[0], hit.split(" ", 1)[1]) not in NOT_TENSOR_KEYS]
    assert not bad, "tensor keys outside omnistage/payloads.py:\n" + "\n".join(bad)


def test_outputs_are_read_through_typed_accessors() -> None:
    bad = [hit for path in RAW_VIEW_SCOPE
           for hit in key_literals(path.read_text(), str(path.relative_to(PACKAGE)),
                                   raw_view_only=True)]
    assert not bad, "keys read from a raw tensors view:\n" + "\n".join(bad)


def test_no_error_field_is_text() -> None:
    bad = [hit for path in ERROR_SCOPE
           for hit in error_text_fields(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not bad, "a failure as text (use error: StageError | None):\n" + "\n".join(bad)


def test_the_checkers_are_not_vacuous() -> None:
    """Each checker finds what it forbids, and passes what the payloads module allows."""
    assert {"hidden.", "token_ids", "codes", "audio", "mm."} <= KEYS | PREFIXES
    src = ('t["codes"]\nt.get("audio")\nx = {"token_ids": ids}\nif "images" in t: pass\n'
           'h = t[f"hidden.{n}"]\nout.tensors.get("video")\nok = state["x"]\n')
    hits = key_literals(src, "m.py")
    assert [h.split(" ")[0] for h in hits] == [f"m.py:{i}" for i in (1, 2, 3, 4, 5, 6)]
    assert key_literals(src, "m.py", raw_view_only=True) == ["m.py:6 'video'"]
    fields = ("class A:\n    error: str | None = None\n    invalid_input: bool = False\n"
              "class B:\n    error: StageError | None = None\n    error_kind: str = ''\n")
    assert [f.split(" ")[1] for f in error_text_fields(fields, "m.py")] == [
        "A.error:", "A.invalid_input:", "B.error_kind:"]


def test_records_pack_and_unpack() -> None:
    """What a record packs is what it unpacks; a chunk's keys no record claims are the
    model's own (ModelTensors)."""
    import torch

    step = payloads.Payload(
        tokens=payloads.TokenDelta([5, 6]),
        hidden=payloads.HiddenRows.from_start({0: torch.ones(2, 4), 3: torch.zeros(2, 4)}, 7, 8),
        thinker_prompt=payloads.ThinkerPrompt([1, 2], torch.ones(3, 4),
                                              {"image_grid_thw": torch.ones(1, 3)}),
        codec=payloads.CodecFrames(torch.ones(1, 16, dtype=torch.long), skip_frames=2),
        audio=payloads.AudioChunk(torch.zeros(10), 24000))
    packed = step.pack()
    back = payloads.Payload.unpack({**packed, "vectors": torch.ones(2)})
    assert back.tokens == step.tokens and back.hidden.positions.tolist() == [7, 8]
    assert back.hidden.num_prompt_tokens == 8 and sorted(back.hidden.layers) == [0, 3]
    assert back.thinker_prompt.prompt_token_ids == [1, 2] and back.codec.skip_frames == 2
    assert back.audio.sample_rate == 24000 and list(back.named.tensors) == ["vectors"]
    inputs = payloads.StageInputs(torch.ones(2, 4), {"pixel_values": torch.ones(1)},
                                  (torch.ones(3, dtype=torch.uint8),) * 2)
    again = payloads.StageInputs.unpack(inputs.pack())
    assert len(again.images) == 2 and "pixel_values" in again.multimodal
    assert again.prompt_embeds is not None and not payloads.Payload()
