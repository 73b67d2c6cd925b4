"""The server process (`python -m serving.server.main`, started by serving/controller.py):

    main               the process's main: dispatcher, services, signals, drain
    paddle_serving_op  Paddle Serving's Python Pipeline Op (HTTP + gRPC)
    openai/            the OpenAI-compatible routes (completions, chat, streaming) and health, on FastAPI
    metrics            Prometheus metrics of the process
    follow             following a models:/ alias (switch versions without failing requests)
    sizes              workers, capacity, threads and the rendered Paddle Serving config.yml
"""
