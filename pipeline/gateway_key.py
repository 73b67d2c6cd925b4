"""`make gateway-key NAME=<consumer> RPM=<n> [TPM=<n>]`: a key for a consumer, printed once as the last line
(`key: sk-...`); `make gateway-key REVOKE=<consumer>`: the consumer's key refused from now on. A running gateway
takes either at once (reloaded: no restart, no request dropped)."""
from __future__ import annotations

from core.config import Config, ConfigError
from serving.gateway import keys, nginx
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "a consumer's key (printed once) with its limits, or REVOKE one"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--name", default="")
    p.add_argument("--rpm", type=int, default=None, help="requests per minute")
    p.add_argument("--tpm", type=int, default=0, help="tokens per minute (0 = no budget)")
    p.add_argument("--revoke", default="", help="a consumer whose key is refused from now on")
    overrides_argument(p, "section.key=value, e.g. gateway.port=18190")


def main(config: Config, args) -> int:
    directory = keys.keys_dir(config)
    if args.revoke:
        if not keys.revoke(directory, args.revoke):
            known = ", ".join(sorted(keys.read(directory))) or "none"
            raise ConfigError(f"REVOKE={args.revoke}: no such consumer (known: {known})")
        reloaded = nginx.reload(config)
        print(f"revoked {args.revoke}" + ("; the gateway refuses its key now" if reloaded else ""))
        return 0
    if not args.name or args.rpm is None:
        raise ConfigError("make gateway-key NAME=<consumer> RPM=<requests per minute> [TPM=<tokens per minute>], or "
                          "REVOKE=<consumer>")
    key = keys.create(directory, args.name, args.rpm, args.tpm)
    reloaded = nginx.reload(config)
    print(f"consumer {args.name}: {args.rpm} requests/min, " + (f"{args.tpm} tokens/min" if args.tpm else
                                                                 "no token budget") +
          f"; kept in {directory / keys.KEYS_FILE} (shown once)" + ("; the gateway takes it now" if reloaded else ""))
    print(f"key: {key}")
    return 0
