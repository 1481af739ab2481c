"""The HTTP client's helpers: Synapse's certificate-whitelist globs, TLS minimums and
proxy credentials."""

from __future__ import annotations

import ssl

from federation_sender.proxy_url import ForwardProxy
from federation_sender.transport.http import (
    compile_globs,
    make_ssl_context,
    proxy_headers,
    unverified_context,
)


def test_globs_match_whole_names_case_insensitively() -> None:
    star, one = compile_globs(["*.example.org", "h?st.test"])
    assert star.fullmatch("a.b.EXAMPLE.org") and not star.fullmatch("example.org")
    assert one.fullmatch("HOST.test") and not one.fullmatch("hoost.test")
    (dots,) = compile_globs(["a.b"])
    assert not dots.fullmatch("axb")  # a dot is a dot, not a regex wildcard


def test_tls_contexts_take_the_configured_minimum() -> None:
    assert make_ssl_context(verify=False, extra_ca_file=None) is False
    ctx = make_ssl_context(verify=True, extra_ca_file=None, min_version="1.3")
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.minimum_version is ssl.TLSVersion.TLSv1_3 and ctx.check_hostname
    loose = unverified_context("1.2")
    assert loose.verify_mode is ssl.CERT_NONE and not loose.check_hostname
    assert loose.minimum_version is ssl.TLSVersion.TLSv1_2


def test_proxy_credentials_become_a_header_only_when_given() -> None:
    assert proxy_headers(None) is None
    assert proxy_headers(ForwardProxy("p.test", 3128)) is None
    assert proxy_headers(ForwardProxy("p.test", 3128, "u", "pw")) == {
        "Proxy-Authorization": "Basic dTpwdw=="
    }
