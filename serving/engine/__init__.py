"""The engine: generation over an export directory, behind any entrypoint.

    scheduler   continuous (or static) batching of jobs over prefill/decode steps
    worker      the process that owns the predictors and runs the scheduler (one per core or GPU)
    dispatch    the server-side client of the workers: routing, capacity, deadlines, restarts, draining
    runtime     paddle.inference predictors and the key/value-cache session
    exported    an export directory as generation sees it: tokenizer, limits, lineage
    generation  sampling and the per-request settings
    placement   where workers run: CPU cores or GPUs

The engine imports only serving/protocol.py of serving/, never the processes above it (server/, client/,
offline/, controller: tests/unit/test_layers.py).
"""
