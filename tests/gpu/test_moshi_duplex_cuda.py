"""GPU-only (skipped without CUDA): the duplex tick's CUDA graphs (issue 45), float32 without
TF32. The batched Mimi streams replayed from real captures (`StreamGraphs` over `MimiStreams`:
streams starting at different steps, one leaving and its slot reused, past the tiny codec's
sliding window) give what each stream gives alone through mimi.py's per-stream
`encode_step` / `decode_step`; the depth transformer's graphs (`RowGraphs` of `run_codebooks`) give eager
`generate`'s codes; and `MoshiDuplex` on CUDA (graphs on by default) gives every session of a
batch what it gives alone, replaying its graphs every tick."""

from __future__ import annotations

import pytest
import torch

from omnistage.layers.graph_capture import RowGraphs, graph_batch_sizes
from omnistage.models.moshi.mimi import MimiModel
from omnistage.models.moshi.mimi_batch import MimiStreams, StreamGraphs
from omnistage.models.moshi.model import MoshiForConditionalGeneration
from omnistage.stages.moshi_duplex import MoshiDuplex
from omnistage.testing.moshi_duplex import build_duplex_moshi
from omnistage.testing.tiny_moshi import build_tiny_mimi

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA, FRAME, K, STEPS = torch.device("cuda"), 96, 4, 12
PLAN = {"a": (0, 0, 12), "b": (1, 2, 5), "c": (1, 6, 12), "d": (2, 5, 12)}   # slot, start, end


@pytest.fixture(autouse=True)
def no_tf32():
    matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv


def _audio(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(STEPS, 1, FRAME, generator=g)).to(CUDA)


def test_graphed_mimi_streams_equal_each_stream_alone(tmp_path):
    path, _ = build_tiny_mimi(tmp_path / "mimi")
    mimi = MimiModel.from_pretrained(path, "", None, CUDA, torch.float32)
    want = {}
    for i, (sid, (_, start, end)) in enumerate(PLAN.items()):
        wav, enc, dec = _audio(i), mimi.new_encode_state(), mimi.new_decode_state()
        codes = [mimi.encode_step(wav[j][None], K, enc)[0, :, 0] for j in range(end - start)]
        want[sid] = (torch.stack(codes), torch.cat([mimi.decode_step(c.view(1, K, 1), dec)[0, 0]
                                                    for c in codes]))
    streams = MimiStreams(mimi, max_rows=3, num_quantizers=K)
    sizes = graph_batch_sizes(3)
    encode = StreamGraphs(streams.encode, sizes, streams.scratch,
                          torch.zeros(1, 1, FRAME, device=CUDA))
    decode = StreamGraphs(streams.decode, sizes, streams.scratch,
                          torch.zeros(1, K, 1, dtype=torch.long, device=CUDA))
    encode.capture_all()
    decode.capture_all()
    got: dict[str, tuple[list, list]] = {sid: ([], []) for sid in PLAN}
    for step in range(STEPS):
        live = [(i, sid) for i, (sid, (_, a, b)) in enumerate(PLAN.items()) if a <= step < b]
        for _, sid in live:
            if PLAN[sid][1] == step:
                streams.reset(PLAN[sid][0])
        slots = torch.tensor([PLAN[sid][0] for _, sid in live], device=CUDA)
        wav = torch.stack([_audio(i)[step - PLAN[sid][1]] for i, sid in live])
        codes = encode(slots, wav)[:, :, 0].clone()
        sound = decode(slots, codes[:, :, None])[:, 0].clone()
        for j, (_, sid) in enumerate(live):
            got[sid][0].append(codes[j])
            got[sid][1].append(sound[j])
    for sid, (codes, sound) in got.items():
        assert torch.equal(torch.stack(codes), want[sid][0]), sid
        peak = want[sid][1].abs().max()
        assert peak > 0.3 and (torch.cat(sound) - want[sid][1]).abs().max() <= 1e-5 * peak, sid
    assert encode.num_replays == decode.num_replays == STEPS


def test_depth_graphs_equal_eager(tmp_path):
    path, _ = build_duplex_moshi(tmp_path / "moshi")
    depth = MoshiForConditionalGeneration.from_pretrained(path).depth_decoder.to(CUDA)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, depth.cfg.input_size, generator=g).to(CUDA)
    text = torch.randint(0, depth.cfg.vocab_size, (5,), generator=g).to(CUDA)
    want = depth.generate(hidden, text)
    depth.graphs = RowGraphs(depth.run_codebooks, (hidden[:1], text[:1]), 8)
    depth.graphs.capture_all()
    for b in (1, 3, 5):
        assert torch.equal(depth.generate(hidden[:b], text[:b]), want[:b])
    assert depth.graphs.num_replays == 3


def test_duplex_on_cuda_batched_equals_alone(tmp_path):
    path, _ = build_duplex_moshi(tmp_path / "moshi")
    duplex = MoshiDuplex(path, device="cuda", max_sessions=3, block_size=4)
    assert duplex.use_graphs and duplex.encode_graphs is not None
    g = torch.Generator().manual_seed(1)
    scripts = {sid: [0.3 * torch.randn(1920, generator=g) for _ in range(6)] for sid in "abc"}

    def run(sids: str) -> dict[str, list]:
        outs: dict[str, list] = {sid: [] for sid in sids}
        for sid in sids:
            duplex.open(sid)
        for tick in range(7):
            frames = {sid: scripts[sid][tick - 1] for sid in sids if tick}
            for sid, out in duplex.tick(frames).items():
                outs[sid].append(out)
        for sid in sids:
            duplex.close(sid)
        return outs

    together = run("abc")
    for sid in "abc":
        alone = run(sid)[sid]
        assert [o.text_id for o in alone] == [o.text_id for o in together[sid]]
        assert all(torch.equal(x.codes, y.codes) for x, y in zip(alone[1:], together[sid][1:]))
        want = torch.cat([o.audio for o in alone[1:]])
        got = torch.cat([o.audio for o in together[sid][1:]])
        assert want.abs().max() > 0.1 and (got - want).abs().max() <= 1e-5 * want.abs().max()
    depth = duplex.model.depth_decoder.graphs
    assert duplex.encode_graphs.num_replays == 6 * 4 and depth is not None
    assert depth.num_replays >= 7 * 4


def test_sampled_sessions_on_cuda_equal_eager(tmp_path):
    """Sampled sessions (DuplexSampling, seeded) replaying the sampled depth graphs give what
    the same sessions give eagerly (the code logits flattened so that the draws show)."""
    from omnistage.stages.moshi_duplex import DuplexSampling

    path, _ = build_duplex_moshi(tmp_path / "moshi")
    graphed = MoshiDuplex(path, device="cuda", max_sessions=3, block_size=4)
    eager = MoshiDuplex(path, device="cuda", max_sessions=3, block_size=4, use_graphs=False)
    sampling = DuplexSampling(temperature=1.0, top_k=20, audio_temperature=1.0,
                              audio_top_k=50, seed=3)
    g = torch.Generator().manual_seed(2)
    script = [0.3 * torch.randn(1920, generator=g) for _ in range(6)]

    def run(duplex: MoshiDuplex) -> list:
        with torch.no_grad():
            duplex.model.depth_decoder.lm_heads.weight.mul_(0.02)
        duplex.open("g")
        duplex.open("s", sampling)
        got = []
        for tick in range(7):
            frames = {sid: script[tick - 1] for sid in "gs"} if tick else {}
            outs = duplex.tick(frames)
            got.append([(outs[sid].text_id, None if outs[sid].codes is None
                         else outs[sid].codes.tolist()) for sid in "gs"])
        return got

    want = run(eager)
    assert run(graphed) == want
    assert [r[1] for r in want] != [r[0] for r in want]
    assert graphed.model.depth_decoder.sampled_graphs.num_replays >= 6
