"""``doctor_report``: one (name, ok, detail) per check; a missing criu is reported clearly."""

from __future__ import annotations

import pytest

from xmig.launch import doctor
from xmig.migrate.criu import ENV_VAR

pytestmark = pytest.mark.timeout(120)


def test_report_shape(capsys: pytest.CaptureFixture[str]) -> None:
    report = doctor.doctor_report()
    names = [name for name, _, _ in report]
    assert names == ["CRIU", "root", "network namespaces", "CUDA checkpoint API"]
    for name, ok, detail in report:
        assert isinstance(name, str) and isinstance(ok, bool)
        assert isinstance(detail, str) and detail.strip(), name
    rc = doctor.run_doctor()
    out = capsys.readouterr().out
    print(out)
    assert rc == (0 if all(ok for _, ok, _ in report) else 1)
    assert all(name in out for name in names)


def test_missing_criu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ENV_VAR, "/nonexistent")
    report = {name: (ok, detail) for name, ok, detail in doctor.doctor_report()}
    ok, detail = report["CRIU"]
    assert not ok
    assert "criu not found" in detail and "/nonexistent" in detail
    assert "install-criu.sh" in detail
    assert doctor.run_doctor() == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_raising_check_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> doctor.Check:
        raise OSError("boom")

    monkeypatch.setattr(doctor, "CHECKS", (broken,))
    assert doctor.doctor_report() == [
        ("broken", False, "the check itself failed: OSError: boom"),
    ]
