"""`make tokenizer`: a byte-level BPE learned from the config's corpus (core/tokenizer.py train_bpe over the
training split: tokenizer.vocab_size tokens, from the first tokenizer.train_mb of text), kept as the tokenizer of the
data set it prepares (so `make train ARGS="tokenizer.kind=bpe"` reuses both) and copied to OUTPUT as a Hugging Face
tokenizer directory (tokenizer.json + tokenizer_config.json) for tokenizer.path; says how many characters a token
holds on the validation split, next to the character vocabulary's one token a character."""
from __future__ import annotations

import shutil
from pathlib import Path

from core.config import Config
from core import REPO_ROOT, dataset
from pipeline.runner.cli import config_argument, overrides_argument
from training.data.prepare import prepare

HELP = "learn a byte-level BPE from the corpus (tokenizer.vocab_size): a Hugging Face tokenizer for tokenizer.path"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--output", default="", help="where the tokenizer directory goes (default runs/tokenizer)")
    overrides_argument(p, "section.key=value overrides, e.g. tokenizer.vocab_size=16000")


def main(config: Config, args) -> int:
    config = config.with_overrides(["tokenizer.kind=bpe", "tokenizer.path="])
    prepared = prepare(config, log=lambda line: print(line, flush=True))
    output = Path(args.output).expanduser() if args.output else REPO_ROOT / config.training.runs_dir / "tokenizer"
    if output.exists():
        shutil.rmtree(output)
    shutil.copytree(prepared.path / dataset.TOKENIZER_DIR, output)
    validation = prepared.manifest["totals"]["validation"]
    documents = validation["documents"]  # (each document's end token is not text)
    per_token = validation.get("chars", 0) / max(validation["tokens"] - documents, 1)
    print(f"tokenizer: byte-level BPE, {prepared.manifest['tokenizer']['vocab_size']:,} tokens "
          f"({'reused' if prepared.reused else 'learned'} with data set {prepared.manifest['key']}): {output}\n"
          f"  validation split: {validation['chars']:,} characters in {validation['tokens'] - documents:,} tokens, "
          f"{per_token:.2f} characters a token\n"
          f"next: make train ARGS=\"tokenizer.kind=bpe tokenizer.vocab_size={config.tokenizer.vocab_size}\" (this "
          f"data set), or tokenizer.path={output} with another corpus", flush=True)
    return 0
