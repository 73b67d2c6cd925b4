"""Grammar-constrained decoding: which tokens a sequence may take next, from a grammar (llguidance: a JSON schema or
a Lark grammar, compiled against the model's own tokens), applied in the scheduler's choose step row by row, so
constrained and free rows share a batch.

Why llguidance (docs/serving.md "Structured output"): a 3 MB wheel without torch, numpy bitmasks, 0.1-0.4 ms for 64
masks at 4.6k-150k tokens; xgrammar imports torch and transformers, outlines-core takes seconds to compile at 150k.

- `token_table(pieces, special_ids, eos_id, encode)`: the model's tokens as llguidance sees them: each id's bytes as
  `decode` writes them (core/tokenizer.py `pieces`), special and empty tokens by name, and an encoder for text it
  forces (a byte-level BPE's own; a character vocabulary's a character at a time).
- `Vocabulary`: an export's tokens read from its files, for the server's checks before dispatch.
- `Grammars`: compiled once per grammar text (cached by it), a fresh matcher per sequence (`deep_copy`).
- `Constraint`: one sequence's matcher; `advance(token)` raises ConstraintError on a token it refuses.
- `allowed_rows(constraints, vocab)`: the rows' masks, and the rows whose matcher is in error (the scheduler ends
  those, and those whose mask allows nothing it may generate, and the others go on).
- `unproducible(text, chars)`: what of a literal the vocabulary cannot write (the default character vocabulary has
  no upper case and no whitespace), checked in the server before a request is dispatched.
"""
from __future__ import annotations

import functools

import numpy as np
import llguidance
import llguidance.numpy as lln
from core import tokenizer as tk


NOTHING_ALLOWED = "the constraint allows no token here: what it needs next is not in this model's vocabulary"


class ConstraintError(RuntimeError):
    """A constrained sequence that cannot go on (matcher error, nothing allowed): it ends with this message."""


class _TokenTable:
    """What llguidance's TokenizerWrapper reads: eos / bos ids, each id's bytes, the special ids, and an encoder."""

    def __init__(self, encode, pieces: list, special_ids: list[int], eos_id: int):
        self.encode, self.eos_token_id, self.bos_token_id = encode, eos_id, None
        self.tokens = [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in pieces]
        # (a token that writes nothing -- a model's own special tokens, <|im_start|> and the like -- is special too:
        # as text it would match the empty string anywhere, and a 0.5B Qwen2 spent its whole budget on them)
        self.special_token_ids = sorted(set(special_ids) | {eos_id} | {i for i, t in enumerate(self.tokens) if not t})
        for i in self.special_token_ids:  # (special tokens by name: llguidance never forces them as text)
            self.tokens[i] = f"<|special-{i}|>".encode()

    def __call__(self, text) -> list[int]:
        return self.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


def token_table(pieces: list, special_ids: list[int], eos_id: int, encode=None):
    """The model's tokens as an llguidance LLTokenizer (~5 ms at 4.6k tokens; once per process): `pieces` each id's
    text or bytes as `decode` writes them, `encode(text) -> ids` the model's own encoder (a byte-level BPE's). A
    character vocabulary is encoded a character at a time, each as its own token: its WordPiece encoder writes a
    latin word it does not know as [UNK] and lower-cases, where a grammar needs the exact text (a character the
    vocabulary lacks becomes a special id, never generated: the constraint then allows nothing and says so)."""
    if encode is None:
        encode = _by_character(pieces, special_ids)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(encode, pieces, special_ids, eos_id)),
                                  n_vocab=len(pieces))


def _by_character(pieces: list, special_ids: list[int]):
    index: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if len(piece) == 1 and i not in special_ids:
            index.setdefault(piece, i)
    unknown = min(special_ids) if special_ids else 0
    return lambda text: [index.get(ch, unknown) for ch in text]


class Vocabulary:
    """An export's tokens as the server checks a request's grammar against them, before dispatch (read from its
    files, with `tokenizers` for a model's own: the server process does not load PaddleNLP's tokenizer classes)."""

    def __init__(self, tokenizer_dir, eos_id: int):
        if tk.is_hf_tokenizer(tokenizer_dir):
            tok = tk.HFTokenizer(tokenizer_dir)
            self.pieces = tok.token_bytes()
            self.special_ids = [i for i in (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id) if i is not None]
            self.encode = lambda text: tok(text)["input_ids"]
        else:
            vocab = tk.read_vocab(tokenizer_dir)
            self.pieces = ["" if t in tk.SPECIAL_TOKENS else t[2:] if t.startswith("##") else t for t in vocab]
            self.special_ids = [i for i, t in enumerate(vocab) if t in tk.SPECIAL_TOKENS]
            self.encode = None  # (a character at a time: token_table)
        self.eos_id = eos_id
        self.chars = producible_characters(self.pieces)

    @functools.cached_property
    def table(self):
        return token_table(self.pieces, self.special_ids, self.eos_id, self.encode)


def producible_characters(pieces: list) -> set[str] | None:
    """The characters the vocabulary can write; None when it writes any (byte-level: every byte has a token)."""
    if pieces and isinstance(pieces[0], bytes):
        single = {p for p in pieces if len(p) == 1}
        return None if len(single) == 256 else {chr(b[0]) for b in single if b[0] < 128}
    return {ch for p in pieces for ch in p}


def unproducible(text: str, chars: set[str] | None) -> str:
    """The characters of `text` the vocabulary cannot write ("" when it can write all)."""
    if chars is None:
        return ""
    return "".join(sorted({ch for ch in text if ch not in chars}))


def check_grammar(grammar: str, table) -> str:
    """"" when llguidance compiles the grammar against this tokenizer, else its message."""
    return llguidance.LLMatcher.validate_grammar(grammar, table)


class Grammars:
    """Compiled grammars of one worker, by their text (a schema sent again compiles once)."""

    def __init__(self, table, size: int = 64):
        self.table = table
        self._compiled = functools.lru_cache(maxsize=size)(self._compile)

    def _compile(self, grammar: str):
        matcher = llguidance.LLMatcher(self.table, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(self._compiled(grammar).deep_copy())


class Constraint:
    """One sequence's matcher over its generated tokens."""

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ConstraintError(f"the constraint refused token {int(token)}: {self.matcher.get_error()}")


def allowed_rows(constraints: list[Constraint], vocab: int) -> tuple[np.ndarray, dict[int, str]]:
    """[k, vocab] booleans: the tokens each constrained sequence may take next; and {row: why} for the rows whose
    matcher is in error. (An empty mask is the scheduler's to find, once it has taken out the ids never generated.)"""
    bitmask = lln.allocate_token_bitmask(len(constraints), vocab)
    # (one row at a time in this thread: 16 rows at 4.6k tokens in 0.053 ms, where LLExecutor's threads took 0.23:
    # its hand-over costs more than the masks, and a worker's cores are busy with the model)
    for row, constraint in enumerate(constraints):
        lln.fill_next_token_bitmask(constraint.matcher, bitmask, row)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    failed = {row: f"the constraint failed: {c.matcher.get_error()}" for row, c in enumerate(constraints)
              if c.matcher.is_error()}
    return allowed, failed
