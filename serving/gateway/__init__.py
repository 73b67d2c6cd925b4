"""The API gateway (docs/gateway.md): nginx in front of the serving replicas.

    nginx.py   the nginx.conf rendered from the settings (keys, limits, pools, split, retries), and the process:
               start, reload (a changed key: no restart, no dropped request), stop
    keys.py    consumers' keys: created, revoked, kept outside the repository (0600)
    usage.py   the usage table: requests, tokens and 429s per consumer and model, from the gateway's access log

nginx cannot count tokens; each replica hands it the answer's `usage` (a header, or a stream's last comment line)
for its access log, and holds each consumer to its tokens per minute (serving/server/consumers.py), from the consumer
header nginx sets.
"""
