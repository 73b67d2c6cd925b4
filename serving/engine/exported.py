"""An export directory as serving uses it: tokenizer, lineage and generation limits around the graph
(core/exportdir.py is the format; nothing here comes from training)."""
from __future__ import annotations

import functools
from pathlib import Path

import serving  # noqa: F401  (zlib first)
from core import exportdir
from serving.engine import runtime
from core.tokenizer import load_tokenizer, pieces, text_of
from serving.protocol import GenerationSettings
from serving.engine.generation import generate, generate_batch
from serving.protocol import RequestError, bad  # noqa: F401  (RequestError: what encode raises)
from core.tokenizer import HFTokenizer
from serving.engine.constraints import Grammars, token_table


def lineage(meta: dict) -> dict[str, str]:
    """What an answer says about the model that gave it (export.json's fields, as strings)."""
    return {"model_name": meta["registered_model_name"], "model_version": str(meta["version"]),
            "source_run_id": meta["source_run_id"], "checkpoint_step": str(meta["checkpoint_step"])}


class ExportedModel:
    def __init__(self, export_dir: Path | str):
        self.dir = Path(export_dir)
        self.meta = exportdir.read_meta(self.dir)
        self.tokenizer = load_tokenizer(exportdir.tokenizer_dir(self.dir))
        tok = self.tokenizer
        self.eos_id = int(self.meta["eos_token_id"])
        # (never generated; a model's own tokenizer may have no unk or mask token, and pad may be its eos)
        self.banned_ids = [i for i in (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.mask_token_id)
                           if i is not None and i != self.eos_id]
        self.max_length = int(self.meta["max_position_embeddings"])
        # (each id's text once: a streamed answer is decoded again at every step, and ErnieTokenizer's
        # convert_ids_to_tokens cost as much as the model's step at 16 streams a worker, profiled)
        self.pieces = pieces(tok)  # (bytes for a model's own byte-level tokenizer: core/tokenizer.py text_of)
        self.pieces[self.eos_id] = self.pieces[self.eos_id][:0]

    @functools.cached_property
    def grammars(self):
        """This model's compiled grammars (its tokens as llguidance reads them: serving/engine/constraints.py),
        built at the first constrained request."""
        tok = self.tokenizer
        encode = (lambda text: tok(text)["input_ids"]) if isinstance(tok, HFTokenizer) else None
        return Grammars(token_table(self.pieces, [*self.banned_ids, self.eos_id], self.eos_id, encode))

    def constraint(self, settings: GenerationSettings):
        """A request's matcher (None when it has no grammar); ConstraintError if its grammar does not compile."""
        return self.grammars.constraint(settings.grammar) if settings.grammar else None

    def encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise bad("`prompt` has no tokens after tokenization", "prompt")
        if len(ids) >= self.max_length:
            raise bad(f"`prompt` is {len(ids)} tokens; the model's maximum length is {self.max_length}", "prompt")
        return ids

    def decode(self, ids: list[int]) -> str:
        """core/tokenizer.py decode, the end token left out; an unfinished character at the end held back."""
        table = self.pieces
        joined = table[0][:0].join(table[i] for i in ids if i < len(table))
        return joined if isinstance(joined, str) else text_of(joined)

    def generate(self, forward, prompt_ids: list[int], settings: GenerationSettings) -> list[int]:
        return generate(forward, prompt_ids, settings, self.eos_id, self.banned_ids, len(self.tokenizer),
                        self.max_length)

    def cached_session(self, threads: int = 1, placement: runtime.Placement = runtime.Placement()):
        """(prefill, decode) over this process's own predictors of the cache programs (serving/engine/runtime.py)."""
        return runtime.cache_session(self.dir, threads, placement)

    def generate_batch(self, session, prompts: list[list[int]], settings: list[GenerationSettings]) -> list[list[int]]:
        prefill, decode = session
        return generate_batch(prefill, decode, prompts, settings, self.eos_id, self.banned_ids, len(self.tokenizer),
                              self.max_length, pad_id=self.tokenizer.pad_token_id)
