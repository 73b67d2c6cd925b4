"""The OpenAI-compatible routes of the server process, split by concern as vLLM's entrypoints are:

    api_server          the FastAPI app in a thread: routes, health, API key, the request body
    protocol            OpenAI's request and response shapes <-> serving/protocol.py
    serving_completion  POST /v1/completions
    serving_chat        POST /v1/chat/completions: the messages rendered with the export's chat template
    streaming           the n sequences of a request on the dispatcher, and Server-Sent Events
"""
