"""bench/pack_home.sh (the GPU scripts' ARCHIVE=): one archive of the results folder, also when
the archive lies inside that folder, rewritten on every call."""
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "pack_home.sh"


def pack(out: Path, home: Path, archive: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{SCRIPT}"; pack_home'],
                          env={"PATH": "/usr/bin:/bin", "out": str(out), "INFERSMITH_HOME": str(home),
                               "ARCHIVE": str(archive)}, capture_output=True, text=True)


def test_an_archive_inside_the_results_folder_holds_everything_but_itself(tmp_path):
    out, home = tmp_path / "r", tmp_path / "home"
    out.mkdir(), home.mkdir()
    (out / "report.md").write_text("table\n")
    (home / "mlflow.db").write_text("runs\n")
    archive = out / "r.tgz"
    for round_ in range(2):  # the second call rewrites the archive that now lies in the folder
        (out / "bench.log").write_text(f"round {round_}\n")
        done = pack(out, home, archive)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""  # no "file changed as we read it"
    assert archive.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "home.tgz", "r.tgz", "report.md"]  # no leftovers
    with tarfile.open(archive) as tar:
        names = sorted(n.removeprefix("./") for n in tar.getnames() if n not in (".", "./"))
        assert names == ["bench.log", "home.tgz", "report.md"]
        assert tar.extractfile("./bench.log").read() == b"round 1\n"
        with tarfile.open(fileobj=tar.extractfile("./home.tgz")) as inner:
            assert "home/mlflow.db" in inner.getnames()
