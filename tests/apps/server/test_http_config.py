"""The training service's HTTP section: the API (which trains and samples the server's model) is never open to the
network without a key."""

import pytest

from apps.server.config import HTTPConfig


@pytest.mark.parametrize("host", ["0.0.0.0", "198.18.0.2", "::", "myhost.example"])
def test_a_network_address_without_an_api_key_is_refused_naming_both_fields(host):
    with pytest.raises(ValueError, match=f"host={host!r} with api_key=None: the training API would be open"):
        HTTPConfig(host=host)
    assert HTTPConfig(host=host, api_key="long-enough-key").host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(host):
    assert HTTPConfig(host=host).api_key is None
