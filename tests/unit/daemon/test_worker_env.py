"""A worker's environment asks glibc for transparent huge pages, and the request takes hold;
it shortens OpenMP's busy wait unless the user said how OpenMP threads wait."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvasir.daemon.environment import OPENMP_SPIN, worker_env


def test_adds_the_huge_page_tunable_and_keeps_everything_else():
    env = worker_env({"PATH": "/bin", "KVASIR_CACHE_DIR": "/c"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert env["PATH"] == "/bin" and env["KVASIR_CACHE_DIR"] == "/c"
    assert set(env) == {"PATH", "KVASIR_CACHE_DIR", "GLIBC_TUNABLES", "GOMP_SPINCOUNT"}


def test_appends_to_a_users_other_tunables():
    env = worker_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("setting", ["glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"])
def test_a_users_own_huge_page_setting_wins(setting):
    assert worker_env({"GLIBC_TUNABLES": setting})["GLIBC_TUNABLES"] == setting


def test_shortens_openmps_busy_wait():
    assert worker_env({})["GOMP_SPINCOUNT"] == OPENMP_SPIN


@pytest.mark.parametrize("setting", [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}])
def test_a_users_own_openmp_wait_wins(setting):
    env = worker_env(setting)
    assert {key: env.get(key) for key in setting} == setting
    assert "GOMP_SPINCOUNT" not in env or "GOMP_SPINCOUNT" in setting


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return "never"
    return path.read_text().split("[", 1)[1].split("]", 1)[0]


_ALLOCATE = """
import torch
weights = torch.ones(64, 1024, 1024)  # 256 MiB, touched
rollup = open("/proc/self/smaps_rollup").read()
print(int(rollup.split("AnonHugePages:")[1].split()[0]))
"""


def _huge_kib(env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", _ALLOCATE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off in this kernel")
@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 35),
    reason="glibc.malloc.hugetlb needs glibc 2.35 or later",
)
def test_a_workers_tensors_land_in_huge_pages(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert _huge_kib(worker_env(os.environ)) >= 128 * 1024  # at least half the tensor
    if _thp_mode() == "madvise":  # without the request, nothing asks for them
        assert _huge_kib(dict(os.environ)) == 0


_SHOW = (
    "import os\n"
    "from kvasir.daemon.environment import exec_in_worker_env\n"
    "exec_in_worker_env(print)\n"
    "print(os.getpid(), os.environ.get('GOMP_SPINCOUNT'), os.environ.get('GLIBC_TUNABLES'))\n"
)


def _bare_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in ("GLIBC_TUNABLES", "GOMP_SPINCOUNT")}


def _shown(argv: list[str], env: dict[str, str]) -> list[str]:
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    fields = out.split()
    assert len(fields) == 3, out  # the line is printed once: by the process run again, not before
    assert int(fields[0]) == process.pid  # the same process, run again
    return fields[1:]


def test_kvasird_runs_itself_again_in_the_workers_environment(tmp_path):
    """Started without the settings (as a console script, and as ``python -c``), the same
    process runs again with them, once; started with them, it goes straight on."""
    script = tmp_path / "kvasird-like"
    script.write_text(f"#!{sys.executable}\n{_SHOW}")
    script.chmod(0o700)
    wanted = worker_env(_bare_env())
    for argv in ([str(script)], [sys.executable, "-c", _SHOW]):
        assert _shown(argv, _bare_env()) == [wanted["GOMP_SPINCOUNT"], wanted["GLIBC_TUNABLES"]]
    own = {**_bare_env(), "GOMP_SPINCOUNT": "7", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert _shown([str(script)], own) == ["7", "glibc.malloc.hugetlb=0"]


def test_the_commands_called_in_process_never_run_the_caller_again(tmp_path):
    """Only the ``kvasird`` program runs itself again: click's runner calling ``start`` in
    a test process (tests/unit/config/test_cluster.py does) leaves that process as it is."""
    called = (
        "import os\n"
        "from click.testing import CliRunner\n"
        "from kvasir.cli.kvasird import kvasird\n"
        f"result = CliRunner().invoke(kvasird, ['start', '--plan', {str(tmp_path / 'absent.toml')!r}])\n"
        "print(os.getpid(), result.exit_code, os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    process = subprocess.Popen([sys.executable, "-c", called], env=_bare_env(), stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=120)
    assert out.split() == [str(process.pid), "2", "None"]
