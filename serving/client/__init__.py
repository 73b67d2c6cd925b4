"""The caller's side of a running server: client (HTTP / gRPC, and its command line) and smoke (`make smoke`)."""
