"""``doctor_report``: one (name, ok, detail) per check; a missing criu is reported clearly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from xmig.launch import doctor
from xmig.migrate.criu import ENV_VAR
from xmig.paths import huge_pages

pytestmark = pytest.mark.timeout(120)


def test_report_shape(capsys: pytest.CaptureFixture[str]) -> None:
    report = doctor.doctor_report()
    names = [name for name, _, _ in report]
    assert names == ["CRIU", "root", "network namespaces", "parking folder", "images folder",
                     "transparent huge pages", "pipe size", "CUDA checkpoint API",
                     "runc"]  # fmt: skip
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


def test_the_parking_folder_is_reported_with_its_pages(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XMIG_PARK_DIR", "/dev/shm")
    ok, detail = doctor.check_park_dir()[1:]
    assert ok and "/dev/shm: tmpfs" in detail
    assert ("4 KiB pages" in detail) == (huge_pages(Path("/dev/shm")) == "never")
    monkeypatch.setenv("XMIG_PARK_DIR", str(tmp_path))  # a disk folder
    ok, detail = doctor.check_park_dir()[1:]
    assert ok  # parking works there, only slower
    assert ("not a tmpfs" in detail) == (huge_pages(tmp_path) is None)
    monkeypatch.setenv("XMIG_PARK_DIR", "/nonexistent/park")
    ok, detail = doctor.check_park_dir()[1:]
    assert not ok and "XMIG_PARK_DIR" in detail


def test_the_images_folder_is_reported_with_its_pages(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XMIG_IMAGES_DIR", "/dev/shm")
    ok, detail = doctor.check_images_dir()[1:]
    assert ok and "/dev/shm (XMIG_IMAGES_DIR): tmpfs" in detail
    assert ("4 KiB pages" in detail) == (huge_pages(Path("/dev/shm")) == "never")
    monkeypatch.setenv("XMIG_IMAGES_DIR", str(tmp_path))
    ok, detail = doctor.check_images_dir()[1:]
    assert ok and ("not a tmpfs" in detail) == (huge_pages(tmp_path) is None)
    monkeypatch.delenv("XMIG_IMAGES_DIR")  # the temp dir
    ok, detail = doctor.check_images_dir()[1:]
    assert ok and "(the temp dir)" in detail
    monkeypatch.setenv("XMIG_IMAGES_DIR", "/nonexistent/images")  # every dump would fail
    ok, detail = doctor.check_images_dir()[1:]
    assert not ok and "/nonexistent/images" in detail and "XMIG_IMAGES_DIR" in detail
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    monkeypatch.setenv("XMIG_IMAGES_DIR", str(read_only))
    ok = doctor.check_images_dir()[1]
    assert ok == (os.geteuid() == 0)  # root writes anywhere; anyone else cannot there


def test_huge_pages_reads_the_mount_that_holds_the_folder() -> None:
    mounts = (
        "tmpfs /dev/shm tmpfs rw,nosuid,size=100k 0 0\n"
        "tmpfs /run/xmig\\040park tmpfs rw,size=60G,huge=within_size 0 0\n"
        "tmpfs /mnt/a tmpfs rw,huge=advise 0 0\n"
        "/dev/vda1 /mnt/a/disk ext4 rw 0 0\n"
    )
    assert huge_pages(Path("/dev/shm"), mounts) == "never"
    assert huge_pages(Path("/run/xmig park/x"), mounts) == "within_size"
    assert huge_pages(Path("/mnt/a/b"), mounts) == "advise"
    assert huge_pages(Path("/mnt/a/disk/b"), mounts) is None  # the mount on top
    assert huge_pages(Path("/mnt/ab"), mounts) is None  # a prefix is not a parent


def test_runc_missing_is_said_and_fails_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XMIG_RUNC", "/nonexistent")
    ok, detail = {name: (ok, d) for name, ok, d in doctor.doctor_report()}["runc"]
    assert ok and "only --container needs it" in detail and "apt install runc" in detail


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[always] madvise never\n", "always: CRIU restores"),
        ("always [madvise] never\n", "madvise: CRIU restores a moving rank's memory in 4 KiB"),
        ("always madvise [never]\n", "never: CRIU restores"),
    ],
)
def test_transparent_huge_pages_are_advice(tmp_path, text, expected):
    setting = tmp_path / "enabled"
    setting.write_text(text)
    name, ok, detail = doctor.check_transparent_huge_pages(setting)
    assert ok and detail.startswith(expected)
    assert ("echo always" in detail) == (not expected.startswith("always"))


def test_a_kernel_without_transparent_huge_pages(tmp_path):
    ok, detail = doctor.check_transparent_huge_pages(tmp_path / "missing")[1:]
    assert ok and "not in this kernel" in detail


def _status(tmp_path, cap_eff):
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n")
    return status


@pytest.mark.parametrize(
    ("limit", "cap_eff", "expected"),
    [
        ("1048576\n", "000001fffeffffff", "fs.pipe-max-size is 1048576 and CAP_SYS_RESOURCE"),
        ("4194304\n", "000001fffeffffff", "fs.pipe-max-size is 4194304: CRIU's dump fills"),
        ("1048576\n", "000001ffffffffff", "CAP_SYS_RESOURCE held"),
    ],
)
def test_pipe_size_is_advice(tmp_path, limit, cap_eff, expected):
    setting = tmp_path / "pipe-max-size"
    setting.write_text(limit)
    name, ok, detail = doctor.check_pipe_size(setting, _status(tmp_path, cap_eff))
    assert ok and detail.startswith(expected)
    assert ("sysctl -w fs.pipe-max-size=4194304" in detail) == ("and CAP" in expected)
    assert ("1024 KiB" in detail) == ("and CAP" in expected)


def test_pipe_size_unreadable(tmp_path):
    ok, detail = doctor.check_pipe_size(tmp_path / "missing", _status(tmp_path, "0"))[1:]
    assert ok and "cannot be read" in detail
