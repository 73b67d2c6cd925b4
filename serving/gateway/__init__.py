"""The API gateway (docs/gateway.md): nginx in front of the serving replicas.

    nginx.py   the nginx.conf rendered from the settings (keys, limits, pools, split, retries), and the process:
               start, reload (a changed key: no restart, no dropped request), stop
    keys.py    consumers' keys: created, revoked, kept outside the repository (0600)
    usage.py   the usage table: requests and 429s from the gateway's access log, tokens from the replicas' metrics

nginx cannot count tokens; the replicas do (serving/server/consumers.py), from the consumer header nginx sets.
"""
