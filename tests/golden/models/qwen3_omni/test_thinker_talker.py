"""Golden: our Qwen3-Omni thinker text model, talker and code predictor vs transformers'
`Qwen3OmniMoeForConditionalGeneration` on the same tiny random checkpoint, in float32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import Qwen3OmniMoeForConditionalGeneration
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerTextRotaryEmbedding, apply_rotary_pos_emb)

from omnistage.layers.attention import forward_context
from omnistage.layers.mrope import MRotaryEmbedding, mrope_axis_of_frequency
from omnistage.models.qwen3_omni.talker import Qwen3OmniTalkerForCausalLM
from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM
from omnistage.testing.tiny_models import PagedCache
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

ATOL = 1e-4   # float32, logits and hidden states O(1)


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni"), with_processor=False)


@pytest.fixture(scope="module")
def hf(omni_path: Path) -> Qwen3OmniMoeForConditionalGeneration:
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        omni_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def thinker(omni_path: Path) -> Qwen3OmniThinkerForCausalLM:
    return Qwen3OmniThinkerForCausalLM.from_pretrained(omni_path)


@pytest.fixture(scope="module")
def talker(omni_path: Path) -> Qwen3OmniTalkerForCausalLM:
    return Qwen3OmniTalkerForCausalLM.from_pretrained(omni_path)


def mrope_positions(num_before: int, grid: tuple[int, int], num_after: int,
                    start: int = 0) -> tuple[Tensor, Tensor]:
    """(3, L) positions of text, one image grid (t fixed, h/w over rows/columns) and text, as
    the reference's get_rope_index lays them out; and the (L,) mask of the image rows."""
    gh, gw = grid
    text0 = torch.arange(start, start + num_before).expand(3, -1)
    base = start + num_before
    hh, ww = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    image = torch.stack([torch.full((gh * gw,), base), base + hh.flatten(), base + ww.flatten()])
    nxt = int(image.max()) + 1
    text1 = torch.arange(nxt, nxt + num_after).expand(3, -1)
    mask = torch.cat([torch.zeros(num_before), torch.ones(gh * gw), torch.zeros(num_after)])
    return torch.cat([text0, image, text1], dim=1), mask.bool()


@torch.no_grad()
def run_batch(model: torch.nn.Module, cache: PagedCache, rows: list[tuple[int, int]],
              positions: Tensor, input_ids: Tensor | None = None,
              inputs_embeds: Tensor | None = None, **kwargs: object
              ) -> tuple[Tensor, dict[int, Tensor]]:
    """One forward pass of the flattened `rows` = (seq id, new tokens) through `cache`."""
    md, _ = cache.step(rows)
    if input_ids is None:
        input_ids = torch.zeros(sum(n for _, n in rows), dtype=torch.long)
    with forward_context(md):
        return model(input_ids, positions, inputs_embeds, **kwargs)


# -- M-RoPE and MoE ------------------------------------------------------------------------------

@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_mrope_matches_hf(part: str, hf: Qwen3OmniMoeForConditionalGeneration) -> None:
    text_cfg = getattr(hf.config, f"{part}_config").text_config
    ref = Qwen3OmniMoeThinkerTextRotaryEmbedding(text_cfg)
    head_dim = text_cfg.head_dim   # 16, and 12 for the talker: its sections overflow D/2 = 6
    ours = MRotaryEmbedding(head_dim, 512, text_cfg.rope_parameters,
                            tuple(text_cfg.rope_parameters["mrope_section"]))
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 500, (3, 9), generator=g)
    q, k = torch.randn(9, 4, head_dim, generator=g), torch.randn(9, 2, head_dim, generator=g)
    cos, sin = ref(q, positions[:, None, :])                      # (1, 9, D)
    torch.testing.assert_close(ours.cos_sin(positions), (cos[0], sin[0]), atol=0, rtol=0)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = ours(positions, q, k)
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    # (T,) positions are t = h = w
    flat = positions[0]
    torch.testing.assert_close(ours.cos_sin(flat), ours.cos_sin(flat.expand(3, -1)), atol=0, rtol=0)


def test_mrope_frequency_layouts() -> None:
    assert mrope_axis_of_frequency(8, (2, 3, 3), interleaved=True).tolist() == \
        [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_axis_of_frequency(6, (2, 3, 3), interleaved=True).tolist() == [0, 1, 2, 0, 1, 2]
    assert mrope_axis_of_frequency(8, (2, 3, 3), interleaved=False).tolist() == \
        [0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="adds up to 8"):
        mrope_axis_of_frequency(6, (2, 3, 3), interleaved=False)


@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_moe_block_matches_hf(part: str, hf: Qwen3OmniMoeForConditionalGeneration,
                              thinker: Qwen3OmniThinkerForCausalLM,
                              talker: Qwen3OmniTalkerForCausalLM) -> None:
    ours = (thinker if part == "thinker" else talker).model.layers[1].mlp
    ref = (hf.thinker.model.language_model if part == "thinker" else hf.talker.model).layers[1].mlp
    assert ours.has_shared_expert == (part == "talker")
    x = torch.randn(37, ours.gate.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(x[None])[0]
        topk_ids, _ = ours.route(x)
        got = ours(x)
        single = ours(x[5:6])                                 # one token: most experts idle
    assert topk_ids.unique().numel() == ours.experts.num_experts   # every expert runs
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(single, expected[5:6], atol=1e-5, rtol=1e-5)


# -- thinker -------------------------------------------------------------------------------------

def test_thinker_prefill_and_decode_match_hf(hf: Qwen3OmniMoeForConditionalGeneration,
                                             thinker: Qwen3OmniThinkerForCausalLM) -> None:
    """Two sequences with image-grid positions prefilled in one flattened pass (inputs_embeds),
    then three decode steps of both (input ids, text positions after the grid)."""
    g = torch.Generator().manual_seed(2)
    layouts = [mrope_positions(3, (2, 3), 2), mrope_positions(2, (2, 2), 1)]
    prompts = [torch.randint(0, 400, (p.shape[1],), generator=g) for p, _ in layouts]
    cache = PagedCache(thinker, num_blocks=32, block_size=4)
    with torch.no_grad():
        embeds = torch.cat([thinker.embed_input_ids(ids) for ids in prompts])
    hidden, _ = run_batch(thinker, cache, [(0, 11), (1, 7)],
                          torch.cat([p for p, _ in layouts], dim=1), inputs_embeds=embeds)
    logits = thinker.compute_logits(hidden)
    ours = [[logits[:11]], [logits[11:]]]
    tokens: list[list[int]] = [[int(logits[10].argmax())], [int(logits[-1].argmax())]]
    next_pos = [int(p.max()) + 1 for p, _ in layouts]
    for step in range(3):
        pos = torch.tensor([next_pos[0] + step, next_pos[1] + step]).expand(3, -1)
        ids = torch.tensor([tokens[0][-1], tokens[1][-1]])
        hidden, _ = run_batch(thinker, cache, [(0, 1), (1, 1)], pos, input_ids=ids)
        logits = thinker.compute_logits(hidden)
        for i in range(2):
            ours[i].append(logits[i:i + 1])
            tokens[i].append(int(logits[i].argmax()))

    for i, (positions, _) in enumerate(layouts):
        full_ids = torch.cat([prompts[i], torch.tensor(tokens[i][:3])])
        decode_pos = torch.arange(next_pos[i], next_pos[i] + 3).expand(3, -1)
        full_pos = torch.cat([positions, decode_pos], dim=1)
        with torch.no_grad():
            ref = hf.thinker(inputs_embeds=hf.thinker.get_input_embeddings()(full_ids)[None],
                             position_ids=full_pos[:, None, :]).logits[0]
        torch.testing.assert_close(torch.cat(ours[i]), ref, atol=ATOL, rtol=0,
                                   msg=lambda m: f"seq {i}: {m}")
        n = len(prompts[i])
        assert tokens[i] == ref[n - 1:].argmax(dim=-1).tolist()


def test_thinker_deepstack_matches_hf(hf: Qwen3OmniMoeForConditionalGeneration,
                                      thinker: Qwen3OmniThinkerForCausalLM) -> None:
    """Deepstack features at the image rows of two flattened sequences, and the captured
    hidden states, equal the reference language model's with visual_pos_masks."""
    g = torch.Generator().manual_seed(3)
    layouts = [mrope_positions(2, (2, 2), 3), mrope_positions(4, (1, 3), 2)]
    lens = [p.shape[1] for p, _ in layouts]
    hidden_size = thinker.model_config.hidden_size
    num_deepstack = len(hf.config.thinker_config.vision_config.deepstack_visual_indexes)
    embeds = [torch.randn(n, hidden_size, generator=g) for n in lens]
    masks = [m for _, m in layouts]
    rows = torch.cat([masks[0].nonzero()[:, 0], lens[0] + masks[1].nonzero()[:, 0]])
    features = torch.randn(num_deepstack, rows.numel(), hidden_size, generator=g)
    num_layers = thinker.model_config.num_hidden_layers
    capture = tuple(range(num_layers + 1))
    positions = torch.cat([p for p, _ in layouts], dim=1)
    hidden, captured = run_batch(thinker, PagedCache(thinker), [(0, lens[0]), (1, lens[1])],
                                 positions, inputs_embeds=torch.cat(embeds),
                                 capture_layers=capture, deepstack=(rows, features))
    plain, _ = run_batch(thinker, PagedCache(thinker), [(0, lens[0]), (1, lens[1])], positions,
                         inputs_embeds=torch.cat(embeds))
    assert (thinker.compute_logits(hidden) - thinker.compute_logits(plain)).abs().max() > 0.1

    lm = hf.thinker.model.language_model
    k0 = int(masks[0].sum())
    for i, (start, feats) in enumerate([(0, features[:, :k0]), (lens[0], features[:, k0:])]):
        with torch.no_grad():
            out = lm(inputs_embeds=embeds[i][None], position_ids=layouts[i][0][:, None, :],
                     visual_pos_masks=masks[i][None], deepstack_visual_embeds=list(feats),
                     output_hidden_states=True)
            ref_logits = hf.thinker.lm_head(out.last_hidden_state)[0]
        span = slice(start, start + lens[i])
        torch.testing.assert_close(thinker.compute_logits(hidden[span]), ref_logits,
                                   atol=ATOL, rtol=0, msg=lambda m: f"seq {i}: {m}")
        for layer in capture:
            torch.testing.assert_close(captured[layer][span], out.hidden_states[layer][0],
                                       atol=ATOL, rtol=0,
                                       msg=lambda m: f"seq {i} layer {layer}: {m}")


def test_thinker_dense_layers_match_hf(tmp_path: Path) -> None:
    """mlp_only_layers / decoder_sparse_step: the dense SwiGLU layers load and run as HF's."""
    from omnistage.testing.tiny_omni import _randomize, build_tiny_omni_tokenizer, tiny_omni_config

    tokenizer = build_tiny_omni_tokenizer(tmp_path)
    config = tiny_omni_config(tokenizer)
    config.thinker_config.text_config.mlp_only_layers = [0]
    config.thinker_config.text_config.decoder_sparse_step = 2   # sparse: layer 1 only
    torch.manual_seed(0)
    ref = Qwen3OmniMoeForConditionalGeneration(config).float().eval()
    _randomize(ref, 0)
    ref.save_pretrained(tmp_path)
    ours = Qwen3OmniThinkerForCausalLM.from_pretrained(tmp_path)
    assert ours.config.moe_layers == (1,)
    ids = torch.randint(0, 400, (8,), generator=torch.Generator().manual_seed(4))
    positions, _ = mrope_positions(2, (2, 2), 2)
    hidden, _ = run_batch(ours, PagedCache(ours), [(0, 8)], positions, input_ids=ids)
    with torch.no_grad():
        expected = ref.thinker(input_ids=ids[None], position_ids=positions[:, None, :]).logits[0]
    torch.testing.assert_close(ours.compute_logits(hidden), expected, atol=ATOL, rtol=0)


# -- talker --------------------------------------------------------------------------------------

def test_talker_prefill_and_decode_match_hf(hf: Qwen3OmniMoeForConditionalGeneration,
                                            thinker: Qwen3OmniThinkerForCausalLM,
                                            talker: Qwen3OmniTalkerForCausalLM) -> None:
    """Talker prompts built from projected thinker embeddings / hidden states plus codec
    embeddings, prefilled together with 3D positions; then decodes of codec ids with (T,)
    positions. Hidden states and codec logits equal HF talker.model + codec_head."""
    g = torch.Generator().manual_seed(5)
    lens = [6, 4]
    text_ids = torch.randint(0, 400, (6,), generator=g)
    thinker_hidden = torch.randn(4, 64, generator=g)
    codec_ids = torch.randint(0, 1088, (10,), generator=g)
    with torch.no_grad():
        text = talker.project_text(thinker.embed_input_ids(text_ids))
        hid = talker.project_hidden(thinker_hidden)
        codec = talker.embed_input_ids(codec_ids)
        ref_text = hf.talker.text_projection(hf.thinker.get_input_embeddings()(text_ids))
        torch.testing.assert_close(text, ref_text, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hid, hf.talker.hidden_projection(thinker_hidden),
                                   atol=1e-5, rtol=1e-5)
    prompts = [text + codec[:6], hid + codec[6:]]
    layouts = [mrope_positions(1, (2, 2), 1)[0], torch.arange(4).expand(3, -1)]
    cache = PagedCache(talker, num_blocks=32, block_size=4)
    hidden, _ = run_batch(talker, cache, [(0, 6), (1, 4)], torch.cat(layouts, dim=1),
                          inputs_embeds=torch.cat(prompts))
    ours_h, ours_l = [[hidden[:6]], [hidden[6:]]], [[talker.compute_logits(hidden[:6])],
                                                    [talker.compute_logits(hidden[6:])]]
    codes = [[int(ours_l[0][0][-1].argmax())], [int(ours_l[1][0][-1].argmax())]]
    next_pos = [int(p.max()) + 1 for p in layouts]
    for step in range(3):
        pos = torch.tensor([next_pos[0] + step, next_pos[1] + step])         # (T,): t = h = w
        hidden, _ = run_batch(talker, cache, [(0, 1), (1, 1)], pos,
                              input_ids=torch.tensor([codes[0][-1], codes[1][-1]]))
        logits = talker.compute_logits(hidden)
        for i in range(2):
            ours_h[i].append(hidden[i:i + 1])
            ours_l[i].append(logits[i:i + 1])
            codes[i].append(int(logits[i].argmax()))

    for i in range(2):
        with torch.no_grad():
            full = torch.cat([prompts[i], hf.talker.get_input_embeddings()(
                torch.tensor(codes[i][:3]))])
            pos = torch.cat([layouts[i], torch.arange(next_pos[i], next_pos[i] + 3).expand(3, -1)],
                            dim=1)
            ref_h = hf.talker.model(inputs_embeds=full[None],
                                    position_ids=pos[:, None, :]).last_hidden_state[0]
            # generate(return_audio=True) suppresses the top 1024 codec ids but EOS
            ref_l = hf.talker.codec_head(ref_h).masked_fill(talker.suppressed, float("-inf"))
        assert talker.suppressed.sum() == min(1024, ref_l.shape[-1]) - 1
        assert not talker.suppressed[hf.config.talker_config.codec_eos_token_id]
        torch.testing.assert_close(torch.cat(ours_h[i]), ref_h, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.cat(ours_l[i]), ref_l, atol=ATOL, rtol=0)
        assert codes[i] == ref_l[lens[i] - 1:].argmax(dim=-1).tolist()


def reference_codes(hf: Qwen3OmniMoeForConditionalGeneration, past_hidden: Tensor,
                    code0: Tensor) -> tuple[Tensor, Tensor]:
    """HF's code predictor greedy generate and the next talker input as the reference builds
    it in Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation."""
    predictor = hf.talker.code_predictor
    with torch.no_grad():
        last_id_hidden = hf.talker.get_input_embeddings()(code0[:, None])          # (B, 1, H)
        result = predictor.generate(
            inputs_embeds=torch.cat((past_hidden[:, None], last_id_hidden), dim=1),
            max_new_tokens=hf.config.talker_config.num_code_groups - 1, do_sample=False,
            output_hidden_states=True, return_dict_in_generate=True)
        mid = [hid[0] for hid in result.hidden_states[1:]]
        last = predictor.get_input_embeddings()[-1](result.sequences[..., -1:])
        embeds = torch.cat([last_id_hidden, *mid, last], dim=1).sum(1)
    return torch.cat([code0[:, None], result.sequences], dim=1), embeds


def test_code_predictor_greedy_matches_hf(hf: Qwen3OmniMoeForConditionalGeneration,
                                          talker: Qwen3OmniTalkerForCausalLM) -> None:
    g = torch.Generator().manual_seed(7)
    past_hidden = torch.randn(5, 48, generator=g)
    code0 = torch.tensor([0, 17, 63, 5, 1082])
    codes, next_embeds = talker.predict_codes(past_hidden, code0)
    ref_codes, ref_embeds = reference_codes(hf, past_hidden, code0)
    assert codes.shape == (5, 4)
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(next_embeds, ref_embeds, atol=1e-5, rtol=1e-5)
    for row in range(5):   # each frame alone gives what it gets in the batch
        alone, alone_embeds = talker.predict_codes(past_hidden[row:row + 1], code0[row:row + 1])
        assert torch.equal(alone[0], codes[row])
        torch.testing.assert_close(alone_embeds[0], next_embeds[row], atol=1e-5, rtol=1e-5)


def test_code_predictor_sampling(talker: Qwen3OmniTalkerForCausalLM) -> None:
    g = torch.Generator().manual_seed(8)
    past_hidden = torch.randn(6, 48, generator=g)
    code0 = torch.randint(0, 64, (6,), generator=g)
    greedy, _ = talker.predict_codes(past_hidden, code0)
    top1, _ = talker.predict_codes(past_hidden, code0, greedy=False, top_k=1, top_p=1.0)
    assert torch.equal(top1, greedy)

    def sample(seeds: list[int], rows: list[int], **kw: object) -> Tensor:
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        codes, embeds = talker.predict_codes(past_hidden[rows], code0[rows], greedy=False,
                                             top_k=0, top_p=1.0, temperature=1.5,
                                             generators=gens, **kw)
        assert embeds.shape == (len(rows), 48)
        return codes

    batch = sample([1, 2, 3, 4, 5, 6], list(range(6)))
    assert torch.equal(batch, sample([1, 2, 3, 4, 5, 6], list(range(6))))      # seeded: replayable
    assert torch.equal(batch[2], sample([3], [2])[0])          # a row's draw ignores its batch
    assert torch.equal(batch[:, 0], code0) and int(batch.max()) < 64
    assert not torch.equal(batch[:, 1:], greedy[:, 1:])
    # per-row parameters: temperature 0 rows stay greedy
    mixed, _ = talker.predict_codes(past_hidden, code0, greedy=False,
                                    temperature=torch.tensor([0.0, 1.5, 0.0, 1.5, 0.0, 1.5]))
    assert torch.equal(mixed[0::2], greedy[0::2])
    with pytest.raises(ValueError, match="generators: 1 for 6 rows"):
        talker.predict_codes(past_hidden, code0, greedy=False, generators=[None])


# -- loading -------------------------------------------------------------------------------------

def test_model_configs(thinker: Qwen3OmniThinkerForCausalLM,
                       talker: Qwen3OmniTalkerForCausalLM, hf) -> None:
    tc = thinker.model_config
    assert (tc.architecture, tc.model_type) == ("Qwen3OmniMoeForConditionalGeneration",
                                                "qwen3_omni_moe_text")
    assert (tc.hidden_size, tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim) == \
        (64, 3, 2, 16)
    assert tc.has_qk_norm and tc.eos_token_ids == (hf.config.im_end_token_id,)
    assert thinker.config.moe_layers == (0, 1, 2) and thinker.config.mrope_section == (2, 3, 3)
    kc = talker.model_config
    assert (kc.vocab_size, kc.hidden_size, kc.head_dim, kc.eos_token_ids) == (1088, 48, 12, (1082,))
    assert talker.config.num_code_groups == 4 and talker.config.text.moe.num_experts == 4
    assert talker.config.text.moe.shared_expert_intermediate_size == 32
    assert not any(n.startswith(("audio_tower", "visual")) for n, _ in thinker.named_parameters())


def _write_checkpoint(src: Path, dst: Path, tensors: dict[str, Tensor], num_shards: int = 1
                      ) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    if num_shards == 1:
        save_file(tensors, dst / "model.safetensors")
        return dst
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[s::num_shards]
        save_file({n: tensors[n] for n in part}, dst / file)
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_sharded_checkpoint_loads_identically(omni_path: Path, tmp_path: Path,
                                              thinker: Qwen3OmniThinkerForCausalLM,
                                              talker: Qwen3OmniTalkerForCausalLM) -> None:
    sharded = _write_checkpoint(omni_path, tmp_path / "sharded",
                                load_file(omni_path / "model.safetensors"), num_shards=3)
    for ours, single in ((Qwen3OmniThinkerForCausalLM.from_pretrained(sharded), thinker),
                         (Qwen3OmniTalkerForCausalLM.from_pretrained(sharded), talker)):
        a, b = ours.state_dict(), single.state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("edit, model_cls, error", [
    ("drop thinker.model.layers.1.mlp.experts.2.up_proj.weight", Qwen3OmniThinkerForCausalLM,
     r"missing tensors: thinker\.model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"),
    ("drop talker.code_predictor.lm_head.2.weight", Qwen3OmniTalkerForCausalLM,
     r"missing tensors: talker\.code_predictor\.lm_head\.2\.weight"),
    ("add thinker.model.layers.0.mlp.extra.weight", Qwen3OmniThinkerForCausalLM,
     r"unexpected tensors \(no parameter takes them\): thinker\.model\.layers\.0\.mlp\.extra"),
    ("add talker.model.layers.0.mlp.experts.7.down_proj.weight", Qwen3OmniTalkerForCausalLM,
     r"talker\.model\.layers\.0\.mlp\.experts\.7\.down_proj\.weight'?: expert 7 out of range"),
    ("reshape talker.model.layers.1.mlp.experts.0.gate_proj.weight", Qwen3OmniTalkerForCausalLM,
     r"experts\.0\.gate_proj\.weight'?: expected shape \(24, 48\), got \(48, 24\)"),
    ("reshape thinker.lm_head.weight", Qwen3OmniThinkerForCausalLM,
     r"lm_head\.weight'?: expected shape \(424, 64\), got \(64, 424\)"),
])
def test_strict_loading_names_the_tensor(edit: str, model_cls: type, error: str,
                                         omni_path: Path, tmp_path: Path) -> None:
    tensors = load_file(omni_path / "model.safetensors")
    op, name = edit.split()
    if op == "drop":
        del tensors[name]
    elif op == "add":
        tensors[name] = torch.zeros(48, 24)
    else:
        tensors[name] = tensors[name].t().contiguous()
    path = _write_checkpoint(omni_path, tmp_path / "edited", tensors)
    with pytest.raises(ValueError, match=error):
        model_cls.from_pretrained(path)


def test_parts_ignore_each_other(omni_path: Path, tmp_path: Path) -> None:
    """The thinker loads without talker / code2wav / encoder tensors, the talker without
    any thinker tensor; a checkpoint that is not Qwen3-Omni is refused."""
    tensors = load_file(omni_path / "model.safetensors")
    only = {n: t for n, t in tensors.items()
            if n.startswith(("thinker.model.", "thinker.lm_head."))}
    Qwen3OmniThinkerForCausalLM.from_pretrained(_write_checkpoint(omni_path, tmp_path / "t", only))
    only = {n: t for n, t in tensors.items() if n.startswith("talker.")}
    Qwen3OmniTalkerForCausalLM.from_pretrained(_write_checkpoint(omni_path, tmp_path / "k", only))
    config = json.loads((omni_path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config["thinker_config"]["text_config"],
                                                 "model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match="expected 'qwen3_omni_moe'"):
        Qwen3OmniThinkerForCausalLM.from_pretrained(bad)


def test_load_in_bfloat16(omni_path: Path, thinker: Qwen3OmniThinkerForCausalLM,
                          talker: Qwen3OmniTalkerForCausalLM) -> None:
    ids = torch.randint(0, 400, (6,), generator=torch.Generator().manual_seed(9))
    for fp32, cls in ((thinker, Qwen3OmniThinkerForCausalLM), (talker, Qwen3OmniTalkerForCausalLM)):
        bf16 = cls.from_pretrained(omni_path, dtype=torch.bfloat16)
        assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
        out = [m.compute_logits(run_batch(m, PagedCache(m), [(0, 6)], torch.arange(6),
                                          input_ids=ids)[0]) for m in (bf16, fp32)]
        assert out[0].dtype == torch.float32
        torch.testing.assert_close(out[0], out[1], atol=0.5, rtol=0.1)
    codes, embeds = bf16.predict_codes(torch.randn(2, 48).bfloat16(), torch.tensor([1, 2]))
    assert codes.shape == (2, 4) and embeds.dtype == torch.bfloat16


class _Rerun:
    """A captured graph's stand-in on CPU: replay reruns the rounds on the static buffers."""

    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.out = fn, fn()

    def replay(self) -> None:
        for dst, src in zip(self.out, self.fn()):
            dst.copy_(src)

    def pool(self) -> None:
        return None


def _rerun_captures(monkeypatch: pytest.MonkeyPatch) -> list[_Rerun]:
    """Captures replaced by `_Rerun`s, listed as they are made."""
    from omnistage.layers import graph_capture

    made: list[_Rerun] = []

    def capture(fn, pool):  # type: ignore[no-untyped-def]
        made.append(_Rerun(fn))
        return made[-1], made[-1].out

    monkeypatch.setattr(graph_capture, "capture_graph", capture)
    return made


def _predict_both(talker: Qwen3OmniTalkerForCausalLM, graphs: object, b: int,
                  gen: torch.Generator) -> None:
    """A frame of b rows, greedy and sampled, through `graphs` equals the eager predictor."""
    predictor = talker.code_predictor
    past = torch.randn(b, 48, generator=gen)
    code0 = torch.randint(0, 64, (b,), generator=gen)
    try:
        for greedy in (True, False):
            results = []
            for use in (None, graphs):
                predictor.graphs = use
                gens = [torch.Generator().manual_seed(i) for i in range(b)]
                results.append(talker.predict_codes(past, code0, greedy=greedy,
                                                    temperature=1.3, generators=gens))
            (codes, embeds), (graph_codes, graph_embeds) = results
            assert torch.equal(graph_codes, codes), (b, greedy)
            torch.testing.assert_close(graph_embeds, embeds, atol=1e-5, rtol=1e-5)
    finally:
        predictor.graphs = None


def test_code_predictor_graphs_buffers(talker: Qwen3OmniTalkerForCausalLM,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`CodePredictorGraphs` on CPU with a stand-in capture whose replay reruns the rounds on
    the static buffers (tests/gpu replays real graphs): frames of 1, 3 (bucket 4, a padding
    row) and 8 rows, greedy and sampled, equal the eager predictor."""
    from omnistage.models.qwen3_omni.code_predictor import CodePredictorGraphs

    _rerun_captures(monkeypatch)
    predictor = talker.code_predictor
    graphs = CodePredictorGraphs(predictor, 8, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(9)
    for b in (1, 3, 8, 3):
        _predict_both(talker, graphs, b, gen)
    assert graphs.num_replays == 8 and set(graphs.graphs) == {
        (1, True), (1, False), (4, True), (4, False), (8, True), (8, False)}


def test_code_predictor_graphs_captured_up_front(talker: Qwen3OmniTalkerForCausalLM,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`capture_all` captures every bucket, greedy and sampled, largest first; frames of
    every size after it replay those graphs, capture nothing and equal the eager predictor."""
    from omnistage.models.qwen3_omni.code_predictor import CodePredictorGraphs

    made = _rerun_captures(monkeypatch)
    graphs = CodePredictorGraphs(talker.code_predictor, 8, torch.device("cpu"), torch.float32)
    graphs.capture_all()
    assert list(graphs.graphs) == [(bs, greedy) for bs in (8, 4, 2, 1)
                                   for greedy in (True, False)]
    assert len(made) == 8
    gen = torch.Generator().manual_seed(4)
    for b in (1, 2, 3, 5, 8):
        _predict_both(talker, graphs, b, gen)
    assert len(made) == 8 and graphs.num_replays == 10
