"""Declared, not probed (issue 39 item 3): in diffusion/, stages/ and engine/ nothing asks an
object by name what it can do (`getattr(x, "name", default)`, `hasattr(x, "name")`). A
pipeline declares its abilities as DiffusionPipeline class attributes (diffusion/pipeline.py),
a stage says what it is through `info()`, and the code reads attributes directly.

The few probes left are of foreign objects whose classes we do not own; each is listed with
its reason. A new entry needs one too."""

from __future__ import annotations

import ast
from pathlib import Path

import omnistage

PACKAGE = Path(omnistage.__file__).parent
SCANNED = ("diffusion", "stages", "engine")

# (file, attribute name) -> why the probe stays
ALLOWED = {
    ("diffusion/diffusers_pipeline.py", "vae_scale_factor"):
        "a diffusers pipeline object: only image pipelines with a VAE have it",
    ("diffusion/diffusers_pipeline.py", "images"):
        "a diffusers pipeline's output dataclass: images or image, by pipeline",
    ("diffusion/diffusers_pipeline.py", "image"):
        "a diffusers pipeline's output dataclass: images or image, by pipeline",
    ("diffusion/diffusers_pipeline.py", "num_timesteps"):
        "a diffusers pipeline during its call: set by most, not all",
    ("stages/process.py", "ended"):
        "a rank's process handle: a subprocess.Popen (foreign) or a Ray actor's RayRank",
    ("engine/chat.py", "chat_template"):
        "a Hugging Face tokenizer or processor: a chat template only where the checkpoint has one",
}


def literal_probes(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each getattr/hasattr call in `path` whose name is a string literal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            found.append((node.lineno, node.args[1].value))
    return found


def test_no_ability_is_probed_by_name() -> None:
    bad, used = [], set()
    for floor in SCANNED:
        for path in sorted((PACKAGE / floor).rglob("*.py")):
            rel = path.relative_to(PACKAGE).as_posix()
            for line, name in literal_probes(path):
                if (rel, name) in ALLOWED:
                    used.add((rel, name))
                else:
                    bad.append(f"{rel}:{line} probes {name!r} by name: declare it (a class "
                               "attribute with a default) and read it directly")
    assert not bad, "\n".join(bad)
    assert used == set(ALLOWED), f"allowlist entries no longer needed: {set(ALLOWED) - used}"


def test_every_pipeline_declares_through_the_base() -> None:
    """Every registered diffusion pipeline (and the test toys) is a DiffusionPipeline, so its
    abilities are the base's attributes, overridden or defaulted."""
    from omnistage import registry
    from omnistage.diffusion.pipeline import DiffusionPipeline
    from omnistage.testing import toy_video  # noqa: F401  (registers the toy family)

    names = {c.name for f in registry.families().values() for c in f.components
             if c.kind == "diffusion"}
    assert {"flux", "wan", "digits_dit", "diffusers", "toy_video"} <= names
    for name in sorted(names):
        cls = registry.load_component("diffusion", name)
        assert issubclass(cls, DiffusionPipeline), name


def test_the_check_sees_probes(tmp_path: Path) -> None:
    """The checker is not vacuous: it finds a getattr and a hasattr with literal names, and
    leaves a computed name alone."""
    src = tmp_path / "m.py"
    src.write_text("def f(p, n):\n    a = getattr(p, 'solver', None)\n"
                   "    b = hasattr(p, \"final_latents\")\n    return getattr(p, n)\n")
    assert literal_probes(src) == [(2, "solver"), (3, "final_latents")]
