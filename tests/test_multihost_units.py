"""One launcher per host: the token every host derives, the endpoint, the job's id."""

import pytest

from xmig.launch.multihost import (
    MultiHostError,
    check_rdzv_id,
    job_token,
    parse_endpoint,
    read_secret,
)


def test_the_token_is_the_same_on_every_host_and_differs_by_job_and_secret():
    secret = "0123456789abcdef0123"
    token = job_token(secret, "job-1")
    assert token == job_token(secret, "job-1") and len(token) == 64
    assert token != job_token(secret, "job-2")
    assert token != job_token(secret + "x", "job-1")
    assert secret not in token


def test_the_secret_comes_from_an_owner_only_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("XMIG_SECRET", raising=False)
    with pytest.raises(MultiHostError, match="needs a secret every host holds"):
        read_secret(None)
    monkeypatch.setenv("XMIG_SECRET", "  " + "e" * 20 + "\n")
    assert read_secret(None) == "e" * 20
    path = tmp_path / "secret"
    path.write_text("f" * 20 + "\n")
    path.chmod(0o600)
    assert read_secret(path) == "f" * 20  # the file wins over the environment
    path.chmod(0o640)
    with pytest.raises(MultiHostError, match=r"readable by others \(mode 640\)"):
        read_secret(path)
    with pytest.raises(MultiHostError, match="cannot read --token-file"):
        read_secret(tmp_path / "missing")
    path.write_text("short")
    path.chmod(0o400)
    with pytest.raises(MultiHostError, match="at least 16 characters"):
        read_secret(path)


def test_the_endpoint_resolves_to_an_address():
    assert parse_endpoint("10.1.2.3:29500") == ("10.1.2.3", 29500)
    assert parse_endpoint("localhost:29500")[1] == 29500
    assert parse_endpoint("[::1]:80") == ("::1", 80)
    for bad in ("host", "host:", ":29500", "host:0", "host:70000", "host:x"):
        with pytest.raises(MultiHostError, match="HOST:PORT"):
            parse_endpoint(bad)
    with pytest.raises(MultiHostError, match="cannot resolve"):
        parse_endpoint("no-such-host.invalid:29500")


def test_the_job_id_is_a_name_for_a_folder():
    assert check_rdzv_id("llama-70b.run_3") == "llama-70b.run_3"
    for bad in ("", "-x", "a/b", "..", "x" * 65, "a b"):
        with pytest.raises(MultiHostError, match="--rdzv-id"):
            check_rdzv_id(bad)
