"""Golden fixtures for MiMo-Audio from the upstream code (XiaomiMiMo/MiMo-Audio).

Run with the reference's own environment (torch + transformers==4.49.0, as upstream pins), never
omnistage's .venv:

    /work/ref-mimo/venv/bin/python scripts/mimo_audio_fixtures.py /path/to/MiMo-Audio-checkout

It builds a TINY random MiMoAudioForCausalLM (the Qwen2 LLM, its input local transformer = patch
encoder, its local transformer = patch decoder; seeded, float32) from the upstream classes, saves
it with `save_pretrained` (the released checkpoint's layout, ~0.5 MB) and records greedy
`generate` outputs for a fixed prompt of text and audio patches:
  * "free": upstream's greedy text sampler (text ids; a non-empty text id gives empty audio);
  * "speak": a text sampler forced to answer <empty> every step, so every step runs the patch
    decoder (greedy, empty ids removed, as upstream's local_forward does) and the next step
    feeds that patch back through the patch encoder.
Patch applied to the upstream source at import: `_prepare_input_embeds` builds its speech
embedding sum in torch.bfloat16 whatever the model's dtype; here it uses the model's dtype
(float32), so the fixture is float32 throughout. Attention is SDPA (no flash-attn).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "mimo_audio"
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            initializer_range=0.25, speech_vocab_size="33-33-17-17-17-17-17-17",
            speech_zeroemb_idx="32-32-16-16-16-16-16-16", delay_pattern="0-1-2-3-4-5-6-7",
            group_size=4, audio_channels=8, local_dim=32, local_layers=2, local_attn_heads=2,
            local_ffn_dim=64, input_local_layers=1, input_local_dim=24)
ARGS = dict(model_name_or_path="tiny", sosp_idx=290, eosp_idx=291, sostm_idx=292, eostm_idx=293,
            eot_idx=294, empty_idx=299)
STEPS = 5


def load_upstream(repo: Path) -> types.ModuleType:
    src = (repo / "src" / "mimo_audio" / "modeling_mimo_audio.py").read_text()
    old = "dtype=torch.bfloat16,"
    assert src.count(old) == 1, "upstream changed: the bfloat16 speech-embedding sum moved"
    mod = types.ModuleType("modeling_mimo_audio")
    sys.modules["modeling_mimo_audio"] = mod
    exec(compile(src.replace(old, "dtype=self.dtype,"), "modeling_mimo_audio.py", "exec"),
         mod.__dict__)
    return mod


def prompt(cfg, empty_idx: int) -> torch.Tensor:
    """(1, T * G * (C + 1)): groups text, text, speech x3, text; each group G rows of
    [text, c0..c7] (upstream's flat layout)."""
    g, c = cfg.group_size, cfg.audio_channels
    sizes, empties = cfg.parsed_speech_vocab_sizes(), cfg.parsed_speech_empty_ids()
    gen = torch.Generator().manual_seed(7)
    groups = []
    for kind, text in (("t", 11), ("t", 57), ("s", 0), ("s", 0), ("s", 0), ("t", 203)):
        rows = torch.empty(g, c + 1, dtype=torch.long)
        if kind == "t":
            rows[:, 0] = text
            rows[:, 1:] = torch.tensor(empties)
        else:
            rows[:, 0] = empty_idx
            for i in range(c):
                rows[:, 1 + i] = torch.randint(0, sizes[i] - 1, (g,), generator=gen)
            rows[0, 8] = empties[7]            # one empty audio id inside a patch
        groups.append(rows)
    return torch.stack(groups).reshape(1, -1)


def main() -> None:
    repo = Path(sys.argv[1])
    commit = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"],
                                     text=True).strip()
    up = load_upstream(repo)
    torch.manual_seed(0)
    cfg = up.MiMoAudioConfig(**TINY)
    cfg._attn_implementation = "sdpa"
    model = up.MiMoAudioForCausalLM(cfg, ARGS).eval()

    class Speak(up.MiMoSampler):
        def sample(self, scores, removed_tokens=None):
            return torch.full(scores.shape[:1], ARGS["empty_idx"], dtype=torch.long)

    ids = prompt(cfg, ARGS["empty_idx"])
    n = ids.shape[1] // (cfg.group_size * (cfg.audio_channels + 1))
    out = {"upstream": "XiaomiMiMo/MiMo-Audio", "commit": commit, "args": ARGS,
           "prompt": ids[0].tolist(), "steps": STEPS}
    for name, sampler in (("free", up.MiMoSampler(do_sample=False)), ("speak", Speak())):
        res = model.generate(ids, max_length=n + STEPS, global_sampler=sampler,
                             local_sampler=up.MiMoSampler(do_sample=False))
        out[name] = res[0, ids.shape[1]:].tolist()
    with torch.no_grad():   # magnitude check: the first step's text logits and local logits
        o = model(ids.reshape(1, n, -1).reshape(1, -1, 9).transpose(1, 2),
                  torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None])
        out["first_text_logits_std"] = float(o.text_logits.std())
    # the released configs set input_full_attention: true (a bidirectional patch encoder):
    # the same weights with that flag, forced speech (the only mode that reads audio patches)
    model.config.input_full_attention = True
    res = model.generate(ids, max_length=n + STEPS, global_sampler=Speak(),
                         local_sampler=up.MiMoSampler(do_sample=False))
    out["speak_full_attention"] = res[0, ids.shape[1]:].tolist()
    assert out["speak_full_attention"] != out["speak"], "input_full_attention had no effect"
    model.config.input_full_attention = None
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT / "tiny", safe_serialization=True)
    (OUT / "tokens.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("commit", "first_text_logits_std")}),
          "\nfree:", out["free"], "\nspeak:", out["speak"])


if __name__ == "__main__":
    main()
