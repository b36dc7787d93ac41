"""A worker's quick exit (``xmig.worker.teardown``): the collector is out of the interpreter's
teardown, and nothing a file buffered is lost for it."""

import subprocess
import sys
import textwrap

import pytest

# a file held only by a reference cycle, with what it wrote still in its buffer at exit
SCRIPT = textwrap.dedent("""
    import atexit, gc, sys
    from xmig.worker import teardown

    class Holder:
        pass

    holder = Holder()
    holder.me = holder
    holder.file = open(sys.argv[2], "w")
    holder.file.write("x" * 100)
    plain = open(sys.argv[3], "w")  # held by a module global
    plain.write("y" * 100)
    mode = sys.argv[1]
    if mode == "quicken":
        atexit.register(teardown.quicken_exit)
    elif mode == "freeze-only":  # what quicken_exit would be without its flush
        atexit.register(lambda: (gc.disable(), gc.freeze()))
    def check():  # registered last, so it runs first: the collector is still on then
        assert gc.isenabled()
    atexit.register(check)
""")


@pytest.mark.parametrize("mode", ["quicken", "freeze-only", "plain"])
def test_a_quick_exit_loses_nothing_a_file_buffered(tmp_path, mode):
    cyclic, plain = tmp_path / "cyclic.txt", tmp_path / "plain.txt"
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(cyclic), str(plain)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    if mode == "freeze-only":
        # without the flush, a frozen teardown loses what the cycle's file buffered (measured:
        # the module global's too, as __main__ is never cleared then)
        assert cyclic.read_text() == ""
    else:
        assert cyclic.read_text() == "x" * 100
        assert plain.read_text() == "y" * 100


def test_flush_open_files_skips_closed_and_read_only_files(tmp_path):
    from xmig.worker.teardown import flush_open_files

    (tmp_path / "r.txt").write_text("r")
    reader = open(tmp_path / "r.txt")  # noqa: SIM115
    closed = open(tmp_path / "c.txt", "w")  # noqa: SIM115
    closed.close()
    writer = open(tmp_path / "w.txt", "w")  # noqa: SIM115
    writer.write("w")
    try:
        assert flush_open_files() >= 1
        assert (tmp_path / "w.txt").read_text() == "w"
    finally:
        reader.close()
        writer.close()
