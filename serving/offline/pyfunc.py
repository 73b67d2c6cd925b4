"""The export directory as an MLflow `python_function` model, so MLflow's own tools load a registered version:
`mlflow.pyfunc.load_model("models:/<name>/<version>")` (notebooks, batch), `mlflow models serve -m models:/...`
(a quick REST endpoint), `mlflow.pyfunc.spark_udf` (batch generation on Spark).

The MLflow model *is* the export directory: export adds MLflow's metadata (export/mlflow_model.py: (`MLmodel`, the pickled
model class, `code/` with the serving code, the pinned requirements, the signature and an input example) next to
the graph, cache programs and tokenizer), and the model's one artifact points at the directory itself, so nothing is
copied. Generation is serving's: the same prefill/decode programs and sampling rule as the Paddle Serving endpoint
(serving/engine/generation.py), so greedy answers are the endpoint's, token for token.
"""
from __future__ import annotations

import json
import os
import sys

import serving  # noqa: F401,I001  (first: zlib before paddle; the paddle_serving_client stand-in)
from core import exportdir
from serving.engine import runtime
from serving.engine.exported import ExportedModel
from serving.protocol import Limits, RequestError, parse
import mlflow.pyfunc

# The artifact name under which the python model finds the export directory (the MLflow model's own root).
EXPORT_ARTIFACT = "export_dir"
# What pyfunc.predict takes: a DataFrame (or list of dicts) with `prompt` and, optionally, these per row (checked by
# the serving protocol, serving/protocol.py, like every entry point's requests).
OPTIONAL_INPUTS = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}
BATCH = 8  # rows generated together (answers do not depend on the batch: serving/engine/generation.py)


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Schema

    inputs = Schema([ColSpec("string", "prompt"), ColSpec("long", "max_new_tokens", required=False),
                     ColSpec("double", "temperature", required=False), ColSpec("long", "top_k", required=False),
                     ColSpec("double", "top_p", required=False), ColSpec("long", "seed", required=False)])
    outputs = Schema([ColSpec("string", "text"), ColSpec(Array("long"), "token_ids")])
    return ModelSignature(inputs=inputs, outputs=outputs)


class GenerationModel(mlflow.pyfunc.PythonModel):
    """Text generation over an export directory (kv-cache programs when the export has them)."""

    # MLflow 3 wraps `predict` for validation from its type hints and warns ("Add type hints to the `predict`
    # method ...") when there are none. The input here is a DataFrame, a dict or a list of dicts, checked by
    # `_rows`/`_parse` and by the explicit signature; no type hint describes that union (`Any` draws another
    # warning). MLflow reads this attribute in PythonModel.__init_subclass__ (its own ChatModel sets it).
    _skip_type_hint_validation = True

    def load_context(self, context):
        self.model = ExportedModel(context.artifacts[EXPORT_ARTIFACT])
        threads = max(1, len(os.sched_getaffinity(0)))
        if exportdir.has_cache_programs(self.model.dir):
            self.session, self.forward = self.model.cached_session(threads), None
        else:  # an export made before the cache programs existed: the full-sequence graph
            predictor = runtime.create_predictor(self.model.dir, threads=threads)
            self.session, self.forward = None, (lambda ids: runtime.predict(predictor, ids))

    def predict(self, context, model_input, params=None):
        import pandas as pd

        prompts, settings = [], []
        for i, row in enumerate(_rows(model_input)):
            prompt, setting = _parse(i, row, self.model.max_length)
            prompts.append(self.model.encode(prompt))
            settings.append(setting)
        new: list[list[int]] = []
        for start in range(0, len(prompts), BATCH):
            chunk, chunk_settings = prompts[start:start + BATCH], settings[start:start + BATCH]
            if self.session is not None:
                new += self.model.generate_batch(self.session, chunk, chunk_settings)
            else:
                new += [self.model.generate(self.forward, p, s) for p, s in zip(chunk, chunk_settings)]
        return pd.DataFrame({"text": [self.model.decode(ids) for ids in new], "token_ids": new})


def _rows(model_input) -> list[dict]:
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        return [{k: v for k, v in row.items() if not _missing(v)} for row in model_input.to_dict("records")]
    if isinstance(model_input, dict):
        return [model_input]
    if isinstance(model_input, list) and all(isinstance(r, dict) for r in model_input):
        return model_input
    raise ValueError("input: a DataFrame or a list of dicts with a `prompt` column (and optionally "
                     f"{', '.join(OPTIONAL_INPUTS)})")


def _missing(value) -> bool:
    try:
        return value is None or value != value  # NaN: a DataFrame row without that optional value
    except (TypeError, ValueError):
        return False


def _parse(i: int, row: dict, max_length: int):
    """One row -> (prompt, settings), checked by the serving protocol; the row's number in every message."""
    unknown = sorted(set(row) - {"prompt", *OPTIONAL_INPUTS})
    if unknown:
        raise RequestError("bad_request", f"row {i}: unknown column(s) {', '.join(unknown)}; allowed: prompt, "
                                          f"{', '.join(OPTIONAL_INPUTS)}")
    values = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}  # (numpy scalars of a DataFrame)
    limits = Limits(max_prompt_chars=1 << 20, max_new_tokens_limit=max_length)
    try:
        request = parse(values, limits)
    except RequestError as exc:
        raise RequestError(exc.kind, f"row {i}: {exc.message}", exc.param) from None
    return request.prompt, request.settings


def main() -> None:  # python -m serving.offline.pyfunc <export dir> [prompt]: one generation, as MLflow loads it
    model = mlflow.pyfunc.load_model(sys.argv[1])
    print(json.dumps(model.predict([{"prompt": sys.argv[2] if len(sys.argv) > 2 else "人工智能"}]).to_dict("records"),
                     ensure_ascii=False, default=list))


if __name__ == "__main__":
    main()
