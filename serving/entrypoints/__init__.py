"""The entrypoints over the engine (serving/engine/), all speaking serving/protocol.py:

    paddle_serving_op  Paddle Serving's Python Pipeline Op (HTTP + gRPC) -- the server process, with
    openai_api         the OpenAI-compatible routes (completions, chat, streaming) and health, on FastAPI
    metrics            Prometheus metrics of that process
    server             `make serve` / `make stop`: that process in the background, its state directory
    client             the Python client (HTTP / gRPC) and its command line
    smoke              `make smoke`: real calls against a running server, checked against the export's references
    pyfunc             the MLflow `python_function` model class (`mlflow.pyfunc.load_model`, spark_udf)
"""
