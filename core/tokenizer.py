"""The tokenizer format shared by training (which builds it), export and serving (which read it), in `tokenizer/` of
a run directory, of a prepared data set and of an export directory. Two kinds:

- this project's own: a character vocabulary (`vocab.txt`) wrapped as PaddleNLP's ErnieTokenizer and saved with
  `save_pretrained`; two readers of the one format: ErnieTokenizer (training, export, serving) and, for preparing
  data at corpus scale, a fast tokenizer (HF `tokenizers`, Rust) configured to give the same ids (`fast_tokenizer`);
- a model's own (a Hugging Face checkpoint's `tokenizer.json` + `tokenizer_config.json`: byte-level BPE as Qwen2 and
  Llama 3 ship, or SentencePiece-style with byte fallback as Llama 2): `HFTokenizer`, the part of PaddleNLP's
  tokenizer interface this project uses over `tokenizers`. Its tokens are bytes, not text: a token may end inside a
  UTF-8 character, so `pieces` gives bytes and `decode` holds an unfinished character back (streaming never shows
  half of one).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from core.errors import ConfigError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# [SEP] separates documents in the packed stream and is the end-of-text token for generation.
EOS_TOKEN = "[SEP]"
# The embedding is padded to a multiple of this so every tensor-parallel degree up to 128 divides the vocabulary.
VOCAB_MULTIPLE = 128


TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
HF_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, "special_tokens_map.json")


def is_hf_tokenizer(directory: Path | str) -> bool:
    """A model's own tokenizer (tokenizer.json), not this project's character vocabulary (vocab.txt)."""
    directory = Path(directory)
    return (directory / TOKENIZER_JSON).is_file() and not (directory / "vocab.txt").is_file()


def load_tokenizer(directory: Path | str):
    if is_hf_tokenizer(directory):
        return HFTokenizer(directory)
    from paddlenlp.transformers import ErnieTokenizer

    return ErnieTokenizer.from_pretrained(str(directory))


def model_vocab_size(tokenizer) -> int:
    """Rows of the model's embedding: the vocabulary padded to VOCAB_MULTIPLE."""
    return -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def decode(tokenizer, ids: list[int]) -> str:
    """Character-level decode: join the tokens without the spaces ErnieTokenizer would put between them. A model's
    own tokenizer: its tokens' bytes joined, an unfinished character at the end held back (`text_of`)."""
    if isinstance(tokenizer, HFTokenizer):
        table = tokenizer.token_bytes()
        return text_of(b"".join(table[i] for i in ids if i < len(table)))
    tokens = tokenizer.convert_ids_to_tokens([i for i in ids if i < len(tokenizer)])
    return "".join(t[2:] if t.startswith("##") else t for t in tokens if t not in SPECIAL_TOKENS)


def pieces(tokenizer) -> list[str] | list[bytes]:
    """Each id's text as `decode` writes it ("" for special tokens), so that decoding is a join over a table: decode
    is token by token, so decode(ids) == "".join(pieces[i] for i in ids) for every id below len(tokenizer). A model's
    own tokenizer: each id's bytes (b"" for special tokens), and decode(ids) == text_of(b"".join(...))."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.token_bytes()
    return [decode(tokenizer, [i]) for i in range(len(tokenizer))]


def text_of(raw: bytes) -> str:
    """UTF-8 bytes as text, without an unfinished character at the end (a byte-level token may stop inside one: it
    is held until the next token completes it, so a stream never shows U+FFFD for it); invalid bytes elsewhere are
    U+FFFD."""
    end = len(raw)
    for back in range(1, min(4, end) + 1):  # (the last lead byte, and whether its sequence is complete)
        byte = raw[end - back]
        if byte & 0xC0 != 0x80:
            needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            if needed > back:
                end -= back
            break
    return raw[:end].decode("utf-8", errors="replace")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def special_token(settings: dict, key: str) -> str:
    """tokenizer_config.json's `key` (bos_token, eos_token, ...): a string, or an AddedToken's {"content"}; "" when
    there is none."""
    value = settings.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else ""


class HFTokenizer:
    """A Hugging Face tokenizer directory as this project uses a tokenizer: `len`, `tok(text, add_special_tokens=
    False)["input_ids"]`, the bos / eos / pad / unk ids (named as ErnieTokenizer's: cls, sep), `save_pretrained`,
    `chat_template` (tokenizer_config.json's jinja, or None) and `token_bytes` (each id's bytes, for `decode`)."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.fast = Tokenizer.from_file(str(self.directory / TOKENIZER_JSON))
        path = self.directory / TOKENIZER_CONFIG
        self.settings = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        self.cls_token_id = self.bos_token_id = self._id("bos_token")
        self.sep_token_id = self.eos_token_id = self._id("eos_token")
        if self.eos_token_id is None:
            raise ConfigError(f"{self.directory}: {TOKENIZER_CONFIG} names no eos_token that {TOKENIZER_JSON} has "
                              "(documents end with it; generation stops at it)")
        self.pad_token_id = self._id("pad_token")
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_id
        self.unk_token_id, self.mask_token_id = self._id("unk_token"), None
        self.chat_template = self.settings.get("chat_template")
        self._bytes: list[bytes] | None = None

    def _id(self, key: str) -> int | None:
        token = special_token(self.settings, key)
        return self.fast.token_to_id(token) if token else None

    def __len__(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.fast.encode(text, add_special_tokens=add_special_tokens).ids}

    def save_pretrained(self, target: Path | str) -> None:
        target = Path(target)
        target.mkdir(parents=True, exist_ok=True)
        for name in HF_FILES:
            if (self.directory / name).is_file():
                (target / name).write_bytes((self.directory / name).read_bytes())

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes: byte-level tokens through GPT-2's alphabet, `<0xNN>` byte-fallback tokens as their byte,
        SentencePiece's "▁" as a space; special (added) tokens b""."""
        if self._bytes is None:
            decoder = json.dumps(json.loads(self.fast.to_str()).get("decoder"))
            added = self.fast.get_added_tokens_decoder()  # (written as text, not in the byte alphabet)
            table = _byte_decoder() if "ByteLevel" in decoder else None
            out = []
            for i in range(len(self)):
                token = self.fast.id_to_token(i)
                if token is None or (i in added and added[i].special):
                    out.append(b"")
                elif i in added:
                    out.append(added[i].content.encode("utf-8"))
                elif table is not None:
                    out.append(bytes(table[c] for c in token if c in table))
                elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                    out.append(bytes([int(token[3:5], 16)]))
                else:
                    out.append(token.replace("\u2581", " ").encode("utf-8"))
            self._bytes = out
        return self._bytes


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
    ("[SEP]", "[UNK]", ...) are matched as those tokens. A model's own tokenizer: its tokenizer.json as it is."""
    if is_hf_tokenizer(directory):
        return Tokenizer.from_file(str(Path(directory) / TOKENIZER_JSON))

    vocab = {token: i for i, token in enumerate(read_vocab(directory))}
    lower = lower_case(directory)
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PADDLENLP_SYMBOLS), "isolated"), pre_tokenizers.BertPreTokenizer()])
    tok.add_special_tokens([t for t in SPECIAL_TOKENS if t in vocab])
    return tok


BPE_SPECIAL = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}


def train_bpe(texts, vocab_size: int, directory: Path | str) -> HFTokenizer:
    """A byte-level BPE (GPT-2's and Qwen2's kind: every byte is a token, so nothing is unknown) trained on `texts`
    with the `tokenizers` library, saved as a Hugging Face tokenizer directory: tokenizer.json and
    tokenizer_config.json with its end-of-text and padding tokens."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(directory / TOKENIZER_JSON))
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **BPE_SPECIAL}, indent=1), encoding="utf-8")
    return HFTokenizer(directory)
