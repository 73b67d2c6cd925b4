"""Serving stage: Paddle Serving Pipeline service, client, start/stop."""
import pipeline  # noqa: F401  (loads zlib before paddle; see pipeline/__init__.py)
