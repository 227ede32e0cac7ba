"""The host agent's start-up check: Monarch's processes listen where the host's name resolves (forge.compat, 19), so
an agent whose name resolves elsewhere, or nowhere, is refused with the fix."""

from __future__ import annotations

import socket

from forge.hosts.agent import own_address_problem


def resolving_to(monkeypatch, *addresses: str) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")

    def getaddrinfo(name, *args, **kwargs):
        if not addresses:
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_that_resolves_to_the_agents_address_passes(monkeypatch):
    resolving_to(monkeypatch, "198.18.0.2")
    assert own_address_problem("198.18.0.2") is None


def test_a_name_that_resolves_elsewhere_is_refused_with_the_fix(monkeypatch):
    resolving_to(monkeypatch, "127.0.1.1")
    problem = own_address_problem("198.18.0.2")
    assert problem == ("this host's name 'node-a' resolves to ['127.0.1.1'], not 198.18.0.2: Monarch's processes here "
                       "would listen there; map 'node-a' to 198.18.0.2 in /etc/hosts")


def test_a_name_that_does_not_resolve_is_refused_with_the_fix(monkeypatch):
    resolving_to(monkeypatch)
    problem = own_address_problem("198.18.0.2")
    assert problem is not None and "this host's name 'node-a' does not resolve" in problem
    assert problem.endswith("map it to 198.18.0.2 in /etc/hosts")
