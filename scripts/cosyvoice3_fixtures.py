"""Regenerate tests/fixtures/cosyvoice3/ from the upstream CosyVoice code (FunAudioLLM/CosyVoice).

    python scripts/cosyvoice3_fixtures.py /path/to/CosyVoice-checkout [--out tests/fixtures/cosyvoice3]

Runs in the reference's own environment (not .venv): python3 -m venv; pip install torch==2.13.0
numpy einops x-transformers==2.11.24 transformers==4.51.3 (the versions upstream's
requirements.txt pins). Pinned
upstream commit: UPSTREAM_COMMIT below (pass the checkout's commit with --commit if it is not a
git work tree; the script refuses another one unless --any-commit).

What it does:
1. builds a TINY random CosyVoice3 token->mel flow (CausalMaskedDiffWithDiT: the token
   embedding, PreLookaheadLayer, speaker affine, CausalConditionalCFM over the DiT estimator)
   and vocoder (CausalHiFTGenerator with CausalConvRNNF0Predictor) with the upstream classes,
   every tensor drawn from one seed in sorted-name order (`seeded_value`), and saves their
   state dicts as flow.pt / hift.pt, the released checkpoint's layout (weight-normed convs as
   `parametrizations.weight.original0/1`), small enough to commit (a few hundred kB);
2. runs the upstream `CausalMaskedDiffWithDiT.inference` (10 Euler steps on the cosine
   schedule, CFG 0.7, its fixed noise: seed 0, randn(1, 80, 15000)) for two cases (different
   prompt/token lengths; the second with streaming=True, i.e. the DiT's chunk mask), then
   `CausalHiFTGenerator.inference` on each mel (finalize=True);
2b. builds CosyVoice3LM over a tiny Qwen2 (transformers' Qwen2ForCausalLM, its text vocabulary
   reaching <|endofprompt|> = 151646, which inference asserts), seeds it the same way (the
   speech decoder's 200 stop rows zeroed so that greedy decoding speaks) and runs its inference
   greedily (argmax in place of ras_sampling) on random text, prompt text ending in
   <|endofprompt|> and prompt speech tokens: the tokens and every step's log-probabilities.
   Its weights (5 M numbers, mostly the text embedding) are not saved: the manifest lists the
   tensors' names and shapes and tests/helpers/cosyvoice3.py redraws them from the seed;
2c. stream mode: upstream's own `CosyVoice3Model.tts(stream=True)` (its token-hop loop and
   `token2wav`) over these flow and vocoder, its LLM a stand-in that yields a fixed token list
   (STREAM_CASES: one request of several hops, one shorter than a hop), the hop set to the
   tiny DiT's chunk (STREAM_HOP: hop * token_mel_ratio = static_chunk_size, as upstream's
   25 x 2 = 50), growing x2 up to STREAM_MAX_HOP as upstream's; every chunk's waveform, and
   the same tokens' whole decode (stream=False), to stream.pt. The vocoder's sine noise is
   first refilled from a seed (STREAM_NOISE_SEED, drawn as omnistage's `SourceNoise.seeded`
   draws it), so the test rebuilds it instead of reading megabytes of it;
3. writes manifest.json (configs, commit, seed, cases) and expected.pt: the inputs (tokens,
   prompt tokens, prompt mel, speaker embedding), the flow's mel, the vocoder's waveform and
   source, and the slices of the vocoder's fixed random buffers (SineGen2.rand_ini,
   SineGen2.sine_waves, SourceModuleHnNSF.uv) the run used: upstream draws them from the global
   RNG when the module is built and never saves them, so the test feeds them to our vocoder.

Stubs made at import time (modules the classes import but these runs never use): matcha's
BASECFM (its __init__ only stores n_feats, n_spks, spk_emb_dim, solver, sigma_min), omegaconf's
DictConfig (attribute access over a dict), cosyvoice.utils.onnx (online_feature=False), the
class registry cosyvoice.utils.class_utils (it imports the LLM and transformers), torchaudio
(only MelSpec uses it) and scipy.signal.get_window('hann', n, fftbins=True) (= the periodic
torch.hann_window). The f0 predictor's classifier bias is set to 150 after seeding, so f0 lies
above the voiced threshold (10 Hz) and the sine source is exercised, not only the noise.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

UPSTREAM_COMMIT = "ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40"
SEED = 1234
MEL = 80                     # CausalConditionalCFM.solve_euler hard-codes 80 mel channels
FLOW_CONFIG = dict(input_size=MEL, output_size=MEL, spk_embed_dim=24, vocab_size=61,
                   token_mel_ratio=2, pre_lookahead_len=3, lookahead_channels=48)
CFM_CONFIG = dict(sigma_min=1e-6, solver="euler", t_scheduler="cosine", training_cfg_rate=0.2,
                  inference_cfg_rate=0.7, reg_loss_type="l1")
DIT_CONFIG = dict(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, mel_dim=MEL, mu_dim=MEL,
                  spk_dim=MEL, out_channels=MEL, static_chunk_size=8, num_decoding_left_chunks=-1)
HIFT_CONFIG = dict(in_channels=MEL, base_channels=16, nb_harmonics=8, sampling_rate=24000,
                   nsf_alpha=0.1, nsf_sigma=0.003, nsf_voiced_threshold=10,
                   upsample_rates=[8, 5, 3], upsample_kernel_sizes=[16, 11, 7],
                   istft_params={"n_fft": 16, "hop_len": 4}, resblock_kernel_sizes=[3, 7, 11],
                   resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                   source_resblock_kernel_sizes=[7, 7, 11],
                   source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                   lrelu_slope=0.1, audio_limit=0.99, conv_pre_look_right=4)
F0_CONFIG = dict(num_class=1, in_channels=MEL, cond_channels=16)
F0_BIAS = 150.0
ENDOFPROMPT = 151646         # CosyVoice3LM.inference asserts this text token is in the prompt
QWEN2_CONFIG = dict(vocab_size=ENDOFPROMPT + 1, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
                    model_type="qwen2")
LLM_CONFIG = dict(llm_input_size=32, llm_output_size=32, speech_token_size=FLOW_CONFIG["vocab_size"])
LLM_CASE = dict(num_text=6, num_prompt_text=4, num_prompt_speech=5, max_token_text_ratio=4,
                min_token_text_ratio=0, input_seed=3)
STREAM_HOP, STREAM_MAX_HOP, STREAM_NOISE_SEED = 4, 16, 7
STREAM_CASES = {     # prompt 5 tokens: the first hop is padded to 4 + 3 (5 + 7 = 3 hops)
    "long": dict(num_prompt_tokens=5, num_tokens=37, streaming=True, input_seed=4),
    "short": dict(num_prompt_tokens=5, num_tokens=3, streaming=True, input_seed=5),
}
CASES = {
    "a": dict(num_prompt_tokens=5, num_tokens=7, streaming=False, input_seed=1),
    "b": dict(num_prompt_tokens=4, num_tokens=9, streaming=True, input_seed=2),
}


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One tensor of the tiny checkpoint: 1-D weights near 1 (Snake alphas, weight-norm
    gains are 3-D and drawn as matrices), biases small, matrices scaled by 1/sqrt(fan_in)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith(("weight", "alpha")) else 0.05 * x
    fan_in = int(np.prod(shape[1:]))
    return x / fan_in ** 0.5


def seed_module(module: torch.nn.Module, seed: int) -> None:
    """Parameters only: buffers (the DiT's rotary inv_freq) keep their computed values."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    module.load_state_dict({n: seeded_value(n, tuple(params[n].shape), gen) for n in sorted(params)},
                           strict=False)


def install_stubs() -> None:
    class BASECFM(torch.nn.Module):
        def __init__(self, n_feats, cfm_params, n_spks=1, spk_emb_dim=128):
            super().__init__()
            self.n_feats, self.n_spks, self.spk_emb_dim = n_feats, n_spks, spk_emb_dim
            self.solver = cfm_params.solver
            self.sigma_min = getattr(cfm_params, "sigma_min", 1e-4)
            self.estimator = None

    class DictConfig(dict):
        __getattr__ = dict.__getitem__

    def get_window(name, n, fftbins=True):
        assert name == "hann" and fftbins
        return torch.hann_window(n, periodic=True, dtype=torch.float64).numpy()

    mods = {"matcha": {}, "matcha.models": {}, "matcha.models.components": {},
            "matcha.models.components.flow_matching": {"BASECFM": BASECFM},
            "omegaconf": {"DictConfig": DictConfig},
            "cosyvoice.utils.file_utils": {"logging": __import__("logging"),
                                           "convert_onnx_to_trt": None,
                                           "export_cosyvoice2_vllm": None},
            "cosyvoice.utils.onnx": {"online_feature": False, "SpeechTokenExtractor": None,
                                     "onnx_path": ""},
            "cosyvoice.utils.class_utils": {k: {} for k in (
                "COSYVOICE_EMB_CLASSES", "COSYVOICE_SUBSAMPLE_CLASSES",
                "COSYVOICE_ATTENTION_CLASSES", "COSYVOICE_ACTIVATION_CLASSES")},
            "torchaudio": {}, "scipy": {}, "scipy.signal": {"get_window": get_window}}
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)    # transformers probes it
        mod.__dict__.update(attrs)
        sys.modules[name] = mod


def build(checkout: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    sys.path.insert(0, str(checkout))
    install_stubs()
    from cosyvoice.flow.DiT.dit import DiT
    from cosyvoice.flow.flow import CausalMaskedDiffWithDiT
    from cosyvoice.flow.flow_matching import CausalConditionalCFM
    from cosyvoice.hifigan.f0_predictor import CausalConvRNNF0Predictor
    from cosyvoice.hifigan.generator import CausalHiFTGenerator
    from cosyvoice.transformer.upsample_encoder import PreLookaheadLayer
    from omegaconf import DictConfig

    f = FLOW_CONFIG
    decoder = CausalConditionalCFM(in_channels=3 * MEL, cfm_params=DictConfig(CFM_CONFIG),
                                   n_spks=1, spk_emb_dim=MEL, estimator=DiT(**DIT_CONFIG))
    flow = CausalMaskedDiffWithDiT(
        input_size=f["input_size"], output_size=f["output_size"],
        spk_embed_dim=f["spk_embed_dim"], vocab_size=f["vocab_size"],
        token_mel_ratio=f["token_mel_ratio"], pre_lookahead_len=f["pre_lookahead_len"],
        pre_lookahead_layer=PreLookaheadLayer(MEL, f["lookahead_channels"], f["pre_lookahead_len"]),
        decoder=decoder)
    torch.manual_seed(SEED)          # the vocoder's fixed random buffers are drawn here
    hift = CausalHiFTGenerator(**HIFT_CONFIG, f0_predictor=CausalConvRNNF0Predictor(**F0_CONFIG))
    seed_module(flow, SEED)
    seed_module(hift, SEED + 1)
    with torch.no_grad():
        hift.f0_predictor.classifier.bias.fill_(F0_BIAS)
    return flow.eval(), hift.eval()


def build_llm(checkout: Path, folder: Path) -> torch.nn.Module:
    """CosyVoice3LM over a tiny Qwen2 saved to `folder` (save_pretrained; its weights are
    rebuilt by the test from the seed, so only the state dict's names and shapes matter)."""
    from cosyvoice.llm.llm import CosyVoice3LM, Qwen2Encoder
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(**QWEN2_CONFIG)).save_pretrained(folder)
    llm = CosyVoice3LM(**LLM_CONFIG, llm=Qwen2Encoder(str(folder)), sampling=greedy)
    seed_module(llm, SEED + 2)
    with torch.no_grad():            # stop rows at zero: the random speech rows win greedily
        llm.llm_decoder.weight[LLM_CONFIG["speech_token_size"]:] = 0
    return llm.eval()


def greedy(weighted_scores: torch.Tensor, decoded_tokens: list, sampling: int) -> int:
    return int(weighted_scores.argmax())


def run_llm(llm: torch.nn.Module) -> dict[str, torch.Tensor]:
    c, gen = LLM_CASE, torch.Generator().manual_seed(LLM_CASE["input_seed"])
    text = torch.randint(0, 1000, (1, c["num_text"]), generator=gen)
    prompt_text = torch.randint(0, 1000, (1, c["num_prompt_text"]), generator=gen)
    prompt_text[0, -1] = ENDOFPROMPT
    prompt_speech = torch.randint(0, LLM_CONFIG["speech_token_size"],
                                  (1, c["num_prompt_speech"]), generator=gen)
    logps = []
    decoder = llm.llm_decoder
    hook = decoder.register_forward_hook(lambda m, i, o: logps.append(o.log_softmax(-1).clone()))
    tokens = list(llm.inference(text, torch.tensor([text.shape[1]]), prompt_text,
                                torch.tensor([prompt_text.shape[1]]), prompt_speech,
                                torch.tensor([prompt_speech.shape[1]]), torch.zeros(1, 0),
                                max_token_text_ratio=c["max_token_text_ratio"],
                                min_token_text_ratio=c["min_token_text_ratio"]))
    hook.remove()
    return {"llm.text": text, "llm.prompt_text": prompt_text, "llm.prompt_speech": prompt_speech,
            "llm.tokens": torch.tensor(tokens), "llm.logp": torch.cat(logps)}


def case_inputs(c: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(c["input_seed"])
    v, n_p, n = FLOW_CONFIG["vocab_size"], c["num_prompt_tokens"], c["num_tokens"]
    return {"token": torch.randint(0, v, (1, n), generator=gen),
            "prompt_token": torch.randint(0, v, (1, n_p), generator=gen),
            "prompt_feat": torch.randn(1, n_p * FLOW_CONFIG["token_mel_ratio"], MEL,
                                       generator=gen) * 2 - 4,
            "embedding": torch.randn(1, FLOW_CONFIG["spk_embed_dim"], generator=gen)}


def run_case(flow, hift, c: dict) -> dict[str, torch.Tensor]:
    x = case_inputs(c)
    mel, _ = flow.inference(x["token"], torch.tensor([x["token"].shape[1]]), x["prompt_token"],
                            torch.tensor([x["prompt_token"].shape[1]]), x["prompt_feat"],
                            torch.tensor([x["prompt_feat"].shape[1]]), x["embedding"],
                            streaming=c["streaming"], finalize=True)        # (1, mel, T)
    wave, source = hift.inference(mel, finalize=True)                       # (1, T * 480)
    return {**x, "mel": mel.clone(), "wave": wave.clone(), "source": source.clone()}


def run_stream(flow, hift, checkout_model, c: dict) -> dict[str, torch.Tensor]:
    """Upstream's `tts` in both modes on one request whose LM yields `token` (a stand-in)."""
    x = case_inputs(c)
    tokens = x["token"][0].tolist()

    class FixedLM:
        def inference(self, **kwargs):
            yield from tokens

    out = {}
    for stream in (True, False):
        model = checkout_model(FixedLM(), flow, hift)
        model.token_hop_len, model.token_max_hop_len = STREAM_HOP, STREAM_MAX_HOP
        chunks = [o["tts_speech"][0].clone() for o in model.tts(
            flow_embedding=x["embedding"], flow_prompt_speech_token=x["prompt_token"],
            prompt_speech_feat=x["prompt_feat"], stream=stream)]
        if stream:
            out.update({f"chunk{i}": w for i, w in enumerate(chunks)})
        else:
            out["whole"] = chunks[0]
    return {**x, **out}


def refill_sine_noise(hift: torch.nn.Module, num_samples: int) -> None:
    """SineGen2's rand_ini and sine_waves (and the source's uv) as omnistage's
    SourceNoise.seeded(STREAM_NOISE_SEED, num_samples, 9) draws them."""
    gen = torch.Generator().manual_seed(STREAM_NOISE_SEED)
    sine = hift.m_source.l_sin_gen
    dim = sine.rand_ini.shape[1]
    sine.rand_ini = torch.rand(1, dim, generator=gen)
    sine.rand_ini[:, 0] = 0
    sine.sine_waves = torch.rand(1, num_samples, dim, generator=gen)
    hift.m_source.uv = torch.rand(1, num_samples, 1, generator=gen)


def commit_of(checkout: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return ""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkout", type=Path)
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/cosyvoice3"))
    p.add_argument("--commit", default="")
    p.add_argument("--any-commit", action="store_true")
    a = p.parse_args()
    commit = a.commit or commit_of(a.checkout)
    if commit != UPSTREAM_COMMIT and not a.any_commit:
        sys.exit(f"checkout is at {commit or '?'}, the fixtures pin {UPSTREAM_COMMIT}")
    torch.set_grad_enabled(False)
    flow, hift = build(a.checkout)
    expected = {}
    for name, c in CASES.items():
        expected.update({f"{name}.{k}": v for k, v in run_case(flow, hift, c).items()})
    with tempfile.TemporaryDirectory() as tmp:
        llm = build_llm(a.checkout, Path(tmp))
        expected.update(run_llm(llm))
    llm_tensors = [[n, list(t.shape)] for n, t in sorted(llm.state_dict().items())]
    n = max(v.shape[-1] for k, v in expected.items() if k.endswith(".source"))
    sine = hift.m_source.l_sin_gen
    expected["noise.rand_ini"] = sine.rand_ini.clone()                     # (1, 9)
    expected["noise.sine_waves"] = sine.sine_waves[:, :n].clone()         # (1, n, 9)
    expected["noise.uv"] = hift.m_source.uv[:, :n].clone()                # (1, n, 1)
    from cosyvoice.cli.model import CosyVoice3Model
    longest = max(c["num_tokens"] for c in STREAM_CASES.values())
    refill_sine_noise(hift, longest * FLOW_CONFIG["token_mel_ratio"] * 480)
    stream = {}
    for name, c in STREAM_CASES.items():
        stream.update({f"{name}.{k}": v for k, v in run_stream(flow, hift, CosyVoice3Model,
                                                                c).items()})
    a.out.mkdir(parents=True, exist_ok=True)
    torch.save(stream, a.out / "stream.pt")
    torch.save(flow.state_dict(), a.out / "flow.pt")
    torch.save(hift.state_dict(), a.out / "hift.pt")
    torch.save(expected, a.out / "expected.pt")
    manifest = {"upstream": "FunAudioLLM/CosyVoice", "commit": commit, "seed": SEED,
                "flow": FLOW_CONFIG, "cfm": CFM_CONFIG, "dit": DIT_CONFIG, "hift": HIFT_CONFIG,
                "f0_predictor": F0_CONFIG, "qwen2": QWEN2_CONFIG, "llm": LLM_CONFIG,
                "llm_case": LLM_CASE, "llm_seed": SEED + 2,
                "llm_tensors": llm_tensors, "endofprompt": ENDOFPROMPT, "f0_bias": F0_BIAS, "n_timesteps": 10, "cases": CASES,
                "magnitudes": {k: float(v.float().abs().max()) for k, v in expected.items()},
                "stream": {"cases": STREAM_CASES, "token_hop_len": STREAM_HOP,
                           "token_max_hop_len": STREAM_MAX_HOP,
                           "noise_seed": STREAM_NOISE_SEED,
                           "magnitudes": {k: float(v.float().abs().max())
                                          for k, v in stream.items()}}}
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for k, v in {**expected, **stream}.items():
        print(f"{k:22s} {tuple(v.shape)} max|x|={v.float().abs().max():.4f}")


if __name__ == "__main__":
    main()
