"""The tiny models' tokenizer: byte-level (one token per UTF-8 byte, no merges) plus chat special tokens.

Built with the `tokenizers` library and saved as a standard Hugging Face tokenizer folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END

# Control tokens: never part of text a user sees; dropped by decode(skip_special_tokens=True).
CONTROL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# Markup tokens: one id each, but kept by decode(skip_special_tokens=True) because tool-call and
# reasoning parsers read them from the decoded text.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
SPECIAL_TOKENS = CONTROL_TOKENS + MARKUP_TOKENS

N_BYTES = 256
VOCAB_SIZE = N_BYTES + len(SPECIAL_TOKENS)  # 265: the tiny models' embedding rows, no padding rows
MODEL_MAX_LENGTH = 1024


def byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: each byte as the printable character the ByteLevel pre-tokenizer uses.

    Printable Latin-1 bytes stand for themselves; the 68 others (controls, space, DEL, NBSP, soft
    hyphen) are shifted to code points 256 and up, in byte order. Token id = byte value.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(N_BYTES) if b not in mapping)
    mapping.update({b: chr(N_BYTES + i) for i, b in enumerate(shifted)})
    return mapping


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE with no merges: an exact round trip for any UTF-8 text, VOCAB_SIZE ids."""
    vocab = {char: byte for byte, char in byte_to_char().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: with no merges the word split changes nothing, so skip it.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {size} ids, expected VOCAB_SIZE={VOCAB_SIZE}")
    return tokenizer


def special_token_ids() -> dict[str, int]:
    """Id of every special token, in the order they follow the 256 byte ids."""
    return {token: N_BYTES + i for i, token in enumerate(SPECIAL_TOKENS)}


def save_tokenizer(out_dir: str | Path, chat_template: str, model_max_length: int = MODEL_MAX_LENGTH) -> Path:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    ids = special_token_ids()
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": t in CONTROL_TOKENS,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        # Loaders must take this class from tokenizer.json; AutoTokenizer may otherwise pick a
        # model-specific class from config.json (see verst.models.loader).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    special_map = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START, IM_END]}
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special_map)
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
