"""The sweep's grid of overrides and its refusals, as logic (fast)."""
import pytest

from core.config import ConfigError
from pipeline.sweep import grid


def test_grid_is_every_combination():
    assert grid(["a.b=1,2", "c.d=x", "e.f=[3,1]", "g.h=0.1,0.2"]) == [
        ["a.b=1", "c.d=x", "e.f=[3,1]", "g.h=0.1"], ["a.b=1", "c.d=x", "e.f=[3,1]", "g.h=0.2"],
        ["a.b=2", "c.d=x", "e.f=[3,1]", "g.h=0.1"], ["a.b=2", "c.d=x", "e.f=[3,1]", "g.h=0.2"]]
    assert grid([]) == [[]]
    with pytest.raises(ConfigError, match="an empty value"):
        grid(["a.b=1,"])
