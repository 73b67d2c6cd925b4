"""The tokenizer format shared by training (which builds it), export and serving (which read it): a character
vocabulary (`vocab.txt`) wrapped as PaddleNLP's ErnieTokenizer and saved with `save_pretrained`, in `tokenizer/` of
a run directory, of a prepared data set and of an export directory.

Two readers of one format: PaddleNLP's ErnieTokenizer (training, export, serving) and, for preparing data at corpus
scale, a fast tokenizer (HF `tokenizers`, Rust) configured to give the same ids (`fast_tokenizer`).
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# [SEP] separates documents in the packed stream and is the end-of-text token for generation.
EOS_TOKEN = "[SEP]"
# The embedding is padded to a multiple of this so every tensor-parallel degree up to 128 divides the vocabulary.
VOCAB_MULTIPLE = 128


def load_tokenizer(directory: Path | str):
    from paddlenlp.transformers import ErnieTokenizer

    return ErnieTokenizer.from_pretrained(str(directory))


def model_vocab_size(tokenizer) -> int:
    """Rows of the model's embedding: the vocabulary padded to VOCAB_MULTIPLE."""
    return -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def decode(tokenizer, ids: list[int]) -> str:
    """Character-level decode: join the tokens without the spaces ErnieTokenizer would put between them."""
    tokens = tokenizer.convert_ids_to_tokens([i for i in ids if i < len(tokenizer)])
    return "".join(t[2:] if t.startswith("##") else t for t in tokens if t not in SPECIAL_TOKENS)


def pieces(tokenizer) -> list[str]:
    """Each id's text as `decode` writes it ("" for special tokens), so that decoding is a join over a table: decode
    is token by token, so decode(ids) == "".join(pieces[i] for i in ids) for every id below len(tokenizer)."""
    return [decode(tokenizer, [i]) for i in range(len(tokenizer))]


# What ErnieTokenizer.save_pretrained writes beside vocab.txt (PaddleNLP 2.8.1), written here without importing it.
_SPECIAL_MAP = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                "mask_token": "[MASK]"}


def write_tokenizer(vocab: list[str], directory: Path | str, do_lower_case: bool = True) -> None:
    """Save a vocabulary as the directory `load_tokenizer` reads (the files ErnieTokenizer.save_pretrained writes)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"do_lower_case": do_lower_case, **_SPECIAL_MAP, "tokenizer_class": "ErnieTokenizer"}), encoding="utf-8")
    (directory / "special_tokens_map.json").write_text(json.dumps(_SPECIAL_MAP), encoding="utf-8")


def read_vocab(directory: Path | str) -> list[str]:
    """The tokens of `vocab.txt`, one a line, in id order (PaddleNLP's Vocab.load_vocabulary rule: strip newlines)."""
    with open(Path(directory) / "vocab.txt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def lower_case(directory: Path | str) -> bool:
    try:
        return bool(json.loads((Path(directory) / "tokenizer_config.json").read_text()).get("do_lower_case", True))
    except (OSError, ValueError):
        return True


# PaddleNLP's BasicTokenizer splits off, besides what BERT's pre-tokenizer splits (whitespace, ASCII non-alphanumerics
# and Unicode P*), every Unicode S* character and these code points (paddlenlp/transformers/tokenizer_utils.py
# _is_symbol): HF's BertPreTokenizer does not, so the fast tokenizer splits them first.
_PADDLENLP_SYMBOLS = r"[\p{S}\x{00AD}\x{00B2}\x{00BA}\x{3007}\x{00B5}\x{00D8}\x{014B}\x{01B1}]"


# A document longer than CHUNK_CHARS is tokenized in chunks of at most PART_CHARS (training/data/shards.py): memory
# follows the chunk, not the document. Whole, a 1.7M-character line took ~230 bytes a character in the Rust
# tokenizer; in 1M-character chunks, ~500 MB and 0.2M characters/s; in 1-8K chunks ~390K characters/s, as short
# documents (docs/data.md).
CHUNK_CHARS = 1 << 16
PART_CHARS = 1 << 12


def _safe_cut(text: str, at: int) -> bool:
    """Whether tokens never span position `at`: the character there is whitespace (words end at it) or a CJK
    ideograph (ErnieTokenizer and the fast tokenizer make each its own token), so the ids of text[:at] and text[at:]
    joined are the ids of the whole."""
    ch = text[at]
    return ch.isspace() or 0x4E00 <= ord(ch) <= 0x9FFF or 0x3400 <= ord(ch) <= 0x4DBF


def chunks(text: str, max_chars: int = CHUNK_CHARS):
    """`text` in consecutive pieces of about max_chars (at most, unless a stretch of max_chars has no safe cut),
    each cut where no token spans the cut: tokenized one by one, their ids joined equal the whole text's."""
    start = 0
    while len(text) - start > max_chars:
        cut = start + max_chars
        while cut > start and not _safe_cut(text, cut):
            cut -= 1
        if cut == start:  # (no safe cut in the window: the next one after it)
            cut = start + max_chars
            while cut < len(text) and not _safe_cut(text, cut):
                cut += 1
            if cut == len(text):
                break
        yield text[start:cut]
        start = cut
    yield text[start:]


def fast_tokenizer(directory: Path | str):
    """A `tokenizers.Tokenizer` over the same vocabulary giving the same ids as `load_tokenizer`'s ErnieTokenizer
    (tests check the whole default corpus and edge cases), ~3x faster. Like it, special tokens written in the text
    ("[SEP]", "[UNK]", ...) are matched as those tokens."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    vocab = {token: i for i, token in enumerate(read_vocab(directory))}
    lower = lower_case(directory)
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PADDLENLP_SYMBOLS), "isolated"), pre_tokenizers.BertPreTokenizer()])
    tok.add_special_tokens([t for t in SPECIAL_TOKENS if t in vocab])
    return tok
