"""Stand-in for the `paddle_serving_client` package (its 0.9.0 wheels exist only for CPython 3.6-3.9).

paddle_serving_server 0.9.0 runs `from paddle_serving_client import Client` when its pipeline modules load, but only
*uses* Client for the C++ brpc client type. The Python Pipeline with `client_type: local_predictor` never calls it.
On Python 3.11 the client role is played by serving/client/client.py (HTTP via requests, gRPC via PipelineClient).
"""


class Client:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("paddle_serving_client.Client (the C++ brpc client) is not available on this Python; "
                           "the pipeline uses client_type: local_predictor and serving/client/client.py")
