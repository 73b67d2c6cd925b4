"""The tokenizer format shared by training (which builds it), export and serving (which read it): a character
vocabulary (`vocab.txt`) wrapped as PaddleNLP's ErnieTokenizer and saved with `save_pretrained`, in `tokenizer/` of
a run directory and of an export directory."""
from __future__ import annotations

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
