"""`models:/` URIs as the serve verb accepts them (MLflow's registry conventions). Fast."""
import pytest

from core.config import ConfigError
from core.registry import parse_models_uri


@pytest.mark.parametrize("uri, expected", [
    ("models:/tiny-zh-llama/3", ("tiny-zh-llama", "3", None)),
    ("models:/tiny-zh-llama/latest", ("tiny-zh-llama", "latest", None)),
    ("models:/tiny-zh-llama@champion", ("tiny-zh-llama", None, "champion")),
])
def test_models_uris(uri, expected):
    assert parse_models_uri(uri) == expected


@pytest.mark.parametrize("uri", ["models:/", "models:/name", "models:/name/v3", "models:/a/b/c", "models:/x@"])
def test_bad_models_uris(uri):
    with pytest.raises(ConfigError, match="expected models:/<name>/<version>"):
        parse_models_uri(uri)
