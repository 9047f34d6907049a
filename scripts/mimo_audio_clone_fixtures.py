"""Golden fixture for MiMo-Audio speaking in a cloned voice, from the upstream code
(XiaomiMiMo/MiMo-Audio src/mimo_audio/mimo_audio.py: get_tts_sft_prompt with prompt_speech,
tts_sft, forward), on the tiny servable folder of tests/helpers/mimo_audio.py.

Run with the reference's own environment (as scripts/mimo_audio_encoder_fixtures.py says: the
transformers==4.49.0 venv, torchaudio installed without its C extension), never omnistage's:

    .venv/bin/python -c "from pathlib import Path; from tests.helpers.mimo_audio import \\
        build_tiny_mimo_audio; build_tiny_mimo_audio(Path('/tmp/mimo_clone'), 0.25)"
    .venv/bin/python -c "from pathlib import Path; from tests.helpers.mimo_audio import \\
        build_tiny_mimo_audio; build_tiny_mimo_audio(Path('/tmp/mimo_clone8k'), 0.25, 8000)"
    /work/ref-mimo/venv/bin/python scripts/mimo_audio_clone_fixtures.py \\
        /path/to/MiMo-Audio-checkout /tmp/mimo_clone /tmp/mimo_clone8k

Upstream's methods run unbound on a stand-in `self` (as in the other fixture scripts) holding
the folder's text tokenizer, upstream's MiMoAudioForCausalLM loaded from the folder (float32;
the bfloat16 speech-embedding sum patched to the model's dtype as scripts/mimo_audio_fixtures.py
does), upstream's MiMoAudioTokenizer from its audio_tokenizer/ (flash-attn: the SDPA stand-in)
and the mel transform upstream's __init__ builds. `random.choice` (the TTS template) is the
first choice; the task's samplers are greedy (do_sample=False) for text and audio.

Recorded in tests/fixtures/mimo_audio/clone.safetensors (the numbers in float32 / int32
tensors, the rest as JSON in its metadata "json"): the reference clip (seeded noise at the audio
tokenizer's rate), and for each case upstream's prompt ((1 + channels, T * group_size) ids) and,
for the cloned voice without an instruction, the codes (channels, frames) that `forward` hands
the audio tokenizer's decoder after STEPS greedy steps (tts_sft's stopping criteria). The spoken
chat in a cloned voice (`get_spoken_dialogue_sft_multiturn_prompt` with prompt_speech, one user
turn of audio; spoken_dialogue_sft_multiturn's stopping criteria) runs on the second folder, the
same weights with the audio tokenizer at 8 kHz (a rate a chat's audio part may have): its clip,
the user's audio, prompt and codes as "dialogue_*". Upstream tests `if prompt_speech:` (a file
path in its examples); the clip is passed as a tensor whose truth is True, turned back into a
plain tensor before upstream's preprocess_input reads it.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mimo_audio_encoder_fixtures import load_upstream as load_with_stubs  # noqa: E402
from mimo_audio_tokenizer_fixtures import OUT  # noqa: E402

STEPS = 12
TEXT = "Hello world."
INSTRUCTION = "Speak slowly."
CLIP_S = 1.5
DIALOGUE_S = 0.6        # the clip and the user's audio of the spoken chat, at 8 kHz


def load_upstream(repo: Path) -> types.ModuleType:
    """mimo_audio.py with its modeling module's bfloat16 speech-embedding sum in the model's
    dtype (float32 here), registered before mimo_audio.py imports it."""
    sys.path.insert(0, str(repo))
    importlib.import_module("src.mimo_audio")
    src = (repo / "src" / "mimo_audio" / "modeling_mimo_audio.py").read_text()
    old = "dtype=torch.bfloat16,"
    assert src.count(old) == 1, "upstream changed: the bfloat16 speech-embedding sum moved"
    name = "src.mimo_audio.modeling_mimo_audio"
    mod = types.ModuleType(name)
    mod.__package__ = "src.mimo_audio"
    sys.modules[name] = mod
    import transformers  # noqa: F401
    exec(compile(src.replace(old, "dtype=self.dtype,"), "modeling_mimo_audio.py", "exec"),
         mod.__dict__)
    return load_with_stubs(repo)


def stand_in(up: types.ModuleType, folder: Path) -> types.SimpleNamespace:
    from tokenizers import Tokenizer
    from torchaudio.transforms import MelSpectrogram
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(
        str(folder / "tokenizer.json")))
    ids = {t: tok.convert_tokens_to_ids(f"<|{t}|>") for t in
           ("sosp", "eosp", "empty", "sostm", "eostm", "eot", "im_end")}
    args = up.MiMoAudioArguments(model_name_or_path=str(folder), sosp_idx=ids["sosp"],
                                 eosp_idx=ids["eosp"], empty_idx=ids["empty"],
                                 sostm_idx=ids["sostm"], eostm_idx=ids["eostm"],
                                 eot_idx=ids["eot"])
    model = up.MiMoAudioForCausalLM.from_pretrained(str(folder), args=args,
                                                    torch_dtype=torch.float32,
                                                    attn_implementation="sdpa").eval()
    codec = importlib.import_module("src.mimo_audio_tokenizer").MiMoAudioTokenizer
    codec = codec.from_pretrained(str(folder / "audio_tokenizer")).eval()
    c = codec.config
    greedy = {"global": up.MiMoSampler(do_sample=False), "local": up.MiMoSampler(do_sample=False)}
    me = types.SimpleNamespace(
        tokenizer=tok, model=model, mimo_audio_tokenizer=codec, device="cpu", history=None,
        group_size=model.config.group_size, audio_channels=model.config.audio_channels,
        speech_zeroemb_idx=model.speech_empty_ids, empty_token=ids["empty"],
        sostm_idx=ids["sostm"], eostm_idx=ids["eostm"], im_end_idx=ids["im_end"],
        generate_kwargs={"max_length": 8192, "eos_token_id": tok.eos_token_id,
                         "pad_token_id": tok.pad_token_id},
        get_task_sampler=lambda name: greedy,
        mel_transform=MelSpectrogram(sample_rate=c.sampling_rate, n_fft=c.nfft,
                                     hop_length=c.hop_length, win_length=c.window_size,
                                     f_min=c.fmin, f_max=c.fmax, n_mels=c.n_mels, power=1.0,
                                     center=True))
    for name in ("get_input_ids", "wav2mel", "encode_batch", "group_by_length",
                 "get_tts_sft_prompt", "get_spoken_dialogue_sft_multiturn_prompt", "forward"):
        setattr(me, name, types.MethodType(getattr(up.MimoAudio, name), me))
    me.preprocess_input = lambda x: up.MimoAudio.preprocess_input(
        me, x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else x)
    return me


class Clip(torch.Tensor):
    """A tensor `if prompt_speech:` takes as given."""
    def __bool__(self) -> bool:
        return True


def speak_codes(up: types.ModuleType, me: types.SimpleNamespace, prompt: torch.Tensor
                ) -> list:
    """Upstream's forward on a prompt, greedy (the stand-in's task samplers), STEPS steps,
    stopping as tts_sft and spoken_dialogue_sft_multiturn do: the codes it decodes."""
    decoded: list[torch.Tensor] = []
    real = me.mimo_audio_tokenizer.decode
    me.mimo_audio_tokenizer.decode = lambda codes: decoded.append(codes) or real(codes)
    stop = [up.MiMoStopper(stop_tokens=[me.tokenizer.eos_token_id, me.eostm_idx, me.im_end_idx],
                           group_size=me.group_size, audio_channels=me.audio_channels)]
    with torch.no_grad():
        me.forward(prompt, return_audio=True, stopping_criteria=stop, max_new_tokens=STEPS,
                   task_name="tts")
    me.mimo_audio_tokenizer.decode = real
    return torch.cat(decoded, dim=1).tolist() if decoded else []


def dialogue(up: types.ModuleType, folder: Path) -> dict:
    me = stand_in(up, folder)
    rate = me.mimo_audio_tokenizer.config.sampling_rate
    gen = torch.Generator().manual_seed(12)
    clip, user = (torch.randn(int(DIALOGUE_S * rate), generator=gen) * 0.3 for _ in range(2))
    with torch.no_grad():
        prompt = me.get_spoken_dialogue_sft_multiturn_prompt(
            [{"role": "user", "content": user}], prompt_speech=clip.as_subclass(Clip))
    prompt = prompt.as_subclass(torch.Tensor).long()
    return {"rate": rate, "clip": clip.tolist(), "user": user.tolist(),
            "prompt": prompt.tolist(), "codes": speak_codes(up, me, prompt)}


def main() -> None:
    repo, folder = Path(sys.argv[1]), Path(sys.argv[2])
    commit = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"],
                                     text=True).strip()
    up = load_upstream(repo)
    up.random.choice = lambda seq: seq[0]
    me = stand_in(up, folder)
    rate = me.mimo_audio_tokenizer.config.sampling_rate
    clip = torch.randn(int(CLIP_S * rate), generator=torch.Generator().manual_seed(11)) * 0.3
    out = {"upstream": "XiaomiMiMo/MiMo-Audio", "commit": commit, "text": TEXT,
           "instruction": INSTRUCTION, "steps": STEPS, "clip_rate": rate, "clip": clip.tolist()}
    with torch.no_grad():
        cases = {"clone": dict(read_text_only=False, prompt_speech=clip),
                 "clone_instruct": dict(instruct=INSTRUCTION, prompt_speech=clip),
                 "instruct": dict(instruct=INSTRUCTION)}
        for name, kwargs in cases.items():
            out[f"{name}_prompt"] = me.get_tts_sft_prompt(TEXT, **kwargs).long().tolist()
    out["clone_codes"] = speak_codes(up, me, torch.tensor(out["clone_prompt"]))
    talk = dialogue(up, Path(sys.argv[3]))
    out.update({f"dialogue_{k}": v for k, v in talk.items()})
    from safetensors.torch import save_file

    meta = {k: v for k, v in out.items() if not isinstance(v, list)}
    tensors = {k: torch.tensor(v, dtype=torch.float32 if k.endswith(("clip", "user"))
                               else torch.int32) for k, v in out.items() if isinstance(v, list)}
    save_file(tensors, str(OUT / "clone.safetensors"),
              metadata={"json": json.dumps(meta, ensure_ascii=False)})
    print(commit, {k: tuple(v.shape) for k, v in tensors.items()})


if __name__ == "__main__":
    main()
