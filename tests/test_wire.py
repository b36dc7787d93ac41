"""Control connections: only holders of the job token get in, requests get replies."""

import threading

import pytest

from xmig.wire import AuthError, Client, RemoteError, Server, WireError


def _echo_server(token):
    seen = []

    def handle(peer, msg):
        seen.append((peer.info, msg))
        if msg.get("op") == "fail":
            raise ValueError("refused on purpose")
        if msg.get("op") == "push_me":
            peer.push({"op": "pushed", "n": 1})
        return {"echo": msg.get("value")}

    return Server("127.0.0.1", 0, token, handle).start(), seen


def test_request_reply_and_push():
    server, seen = _echo_server("secret")
    pushed = threading.Event()
    client = Client(server.address, "secret", info={"role": "test"}, on_push=lambda m: pushed.set())
    try:
        assert client.call("echo", value=[1, 2])["echo"] == [1, 2]
        with pytest.raises(RemoteError, match="refused on purpose"):
            client.call("fail")
        client.call("push_me")
        assert pushed.wait(5)
        assert seen[0][0] == {"role": "test"}
    finally:
        client.close()
        server.close()


def test_wrong_token_is_refused():
    server, seen = _echo_server("secret")
    try:
        with pytest.raises(AuthError, match="wrong job token"):
            Client(server.address, "not-the-secret")
        assert seen == []
    finally:
        server.close()


def test_client_checks_the_server_too():
    # a server that does not hold the token cannot pose as the coordinator
    server, _ = _echo_server("other")
    try:
        with pytest.raises(AuthError):
            Client(server.address, "secret")
    finally:
        server.close()


def test_unreachable():
    server, _ = _echo_server("secret")
    address = server.address
    server.close()
    with pytest.raises(WireError, match="cannot reach"):
        Client(address, "secret", connect_timeout=2)
