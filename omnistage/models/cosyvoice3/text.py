"""CosyVoice3's text front end: the Qwen2 tokenizer of the folder's CosyVoice-BlankEN/ with
the special tokens upstream's `CosyVoice3Tokenizer` adds (FunAudioLLM/CosyVoice @ace7c47,
cosyvoice/tokenizer/tokenizer.py: in this order, so `<|endofprompt|>` is 151646 on the
released vocabulary), and upstream's light text normalisation.

Normalisation: upstream runs ttsfrd or wetext when installed, else a light fallback; this is
the light one (`CosyVoiceFrontEnd.text_normalize` without wetext or ttsfrd): text holding
`<|...|>` markup is left as it is; Chinese text loses newlines and the blanks not between two
ASCII characters, spells out ² and ³, turns "." into "。" and " - " into "，", drops
（）【】` and turns a trailing comma into "。". Not ported: English numbers spelled out with
`inflect`, and `split_paragraph` (upstream speaks a long text as pieces of 60 to 80 tokens,
one LM call each; here one request speaks its whole text in one LM call).
"""

from __future__ import annotations

import re
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

TOKENIZER_FOLDER = "CosyVoice-BlankEN"
ENDOFPROMPT_TEXT = "<|endofprompt|>"
SYSTEM_PROMPT = "You are a helpful assistant." + ENDOFPROMPT_TEXT   # upstream's examples' prefix

_PINYIN = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo "
    "iè ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o "
    "ong ou p q r s sh t u uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā "
    "uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng "
    "áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān "
    "āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng "
    "ǒu ǔ ǔn ǘ ǚ ǜ").split()
_ARPABET = [p + s for p in ("AA AE AH AO AW AY").split() for s in ("", "0", "1", "2")] + \
    ["B", "CH", "D", "DH"] + [f"EH{s}" for s in ("", "0", "1", "2")] + \
    [f"ER{s}" for s in ("", "0", "1", "2")] + [f"EY{s}" for s in ("", "0", "1", "2")] + \
    ["F", "G", "HH"] + [f"IH{s}" for s in ("", "0", "1", "2")] + \
    [f"IY{s}" for s in ("", "0", "1", "2")] + ["JH", "K", "L", "M", "N", "NG"] + \
    [f"OW{s}" for s in ("", "0", "1", "2")] + [f"OY{s}" for s in ("", "0", "1", "2")] + \
    ["P", "R", "S", "SH", "T", "TH"] + [f"UH{s}" for s in ("", "0", "1", "2")] + \
    [f"UW{s}" for s in ("", "0", "1", "2")] + ["V", "W", "Y", "Z", "ZH"]
SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", ENDOFPROMPT_TEXT, "[breath]", "<strong>", "</strong>",
    "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]",
    "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]",
    "[mn]", "<|endofsystem|>", *(f"[{p}]" for p in _ARPABET), *(f"[{p}]" for p in _PINYIN))

_CHINESE = re.compile(r"[\u4e00-\u9fff]+")


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """The folder's Qwen2 tokenizer with CosyVoice3's special tokens added."""
    tok = AutoTokenizer.from_pretrained(str(Path(folder) / TOKENIZER_FOLDER))
    tok.add_special_tokens({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                            "additional_special_tokens": list(SPECIAL_TOKENS)})
    return tok


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer([text])["input_ids"][0])


def _replace_blank(text: str) -> str:
    keep = [c for i, c in enumerate(text)
            if c != " " or (0 < i < len(text) - 1 and text[i + 1].isascii()
                            and text[i + 1] != " " and text[i - 1].isascii()
                            and text[i - 1] != " ")]
    return "".join(keep)


def normalize(text: str) -> str:
    """Upstream's light normalisation (no wetext, no ttsfrd, no split): see the module doc."""
    if ("<|" in text and "|>" in text) or not text:
        return text
    text = text.strip()
    if not _CHINESE.search(text):
        return text
    text = _replace_blank(text.replace("\n", ""))
    text = text.replace("²", "平方").replace("³", "立方").replace(".", "。").replace(" - ", "，")
    for c in ("（", "）", "【", "】", "`"):
        text = text.replace(c, "")
    text = text.replace("——", " ")
    return re.sub(r"[，,、]+$", "。", text)
