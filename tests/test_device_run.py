"""benchmarks/device_run.sh's N-ranks mode, dry run (its commands printed, none run): every
item at every N runs once, in lanes of about equal work; the whole set has every GPU file. Also
the flaggemm and paced modes' shape specs; and, run for real, what a failed item leaves."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ITEM = re.compile(r"\[dry run\] ranks=(\d+) tests/(\S+?)(?: -k \"([^\"]+)\")?: timeout -k 75 (\d+)")


def _device_run(
    out, *args: str, mode: str = "ranks", dry: bool = True, **env: str
) -> subprocess.CompletedProcess:
    """device_run.sh MODE ARGS with $OUT at `out`: a dry run (commands printed), or for real."""
    env = dict(os.environ, OUT=str(out), **({"DRY_RUN": "1"} if dry else {}), **env)
    cmd = ["bash", str(ROOT / "benchmarks" / "device_run.sh"), mode, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _dry_run(tmp_path, *args: str, mode: str = "ranks", **env: str) -> subprocess.CompletedProcess:
    return _device_run(tmp_path, *args, mode=mode, **env)


def test_every_item_at_every_n_once_in_balanced_lanes(tmp_path):
    files = "a.py:100 b.py@x+and+not+y:300 c.py:200 d.py:50 e.py:70"
    done = _dry_run(tmp_path, RANKS="2 8", RANKS_PARALLEL="3", RANKS_FILES=files)
    assert done.returncode == 0, done.stdout + done.stderr
    items = ITEM.findall(done.stdout)
    want = {
        (n, f, k, s)
        for n in ("2", "8")
        for f, k, s in [
            ("a.py", "", "100"),
            ("b.py", "x and not y", "300"),
            ("c.py", "", "200"),
            ("d.py", "", "50"),
            ("e.py", "", "70"),
        ]
    }
    assert sorted(items) == sorted(want), done.stdout
    loads = [int(x) for x in re.findall(r"-- lane \d+ \(GPU 0, about (\d+) s", done.stdout)]
    # longest first, each to the least loaded lane: 300 100 70, 300 100 70, 200 200 50 50
    assert sorted(loads) == [470, 470, 500], loads


def test_the_whole_set_has_every_gpu_file(tmp_path):
    done = _dry_run(tmp_path, "all", RANKS="4")
    assert done.returncode == 0, done.stdout + done.stderr
    ran = {f for _, f, _, _ in ITEM.findall(done.stdout)}
    # processes of their own, not ranks: the shared-GPU step and a one-GPU file
    own = {"test_gpu_multiprocess.py", "test_gpu_gemm_cache.py"}
    assert ran == {p.name for p in (ROOT / "tests").glob("test_gpu*.py")} - own
    assert "test_gpu_multiprocess.py -k one_gpu\\ or\\ one_shared_gpu" in done.stdout


def test_the_heavy_files_run_one_after_another(tmp_path):
    """test_gpu.py's items at every N in one lane (each rank holds GiBs), the rest dealt."""
    done = _dry_run(tmp_path, "all", RANKS="2 4 8", RANKS_PARALLEL="4", RANKS_GPU_MIB="143771")
    assert done.returncode == 0, done.stdout + done.stderr
    lanes = re.split(r"^-- lane \d+ ", done.stdout, flags=re.M)[1:]
    assert len(lanes) == 4
    holding = [i for i, text in enumerate(lanes) if "tests/test_gpu.py:" in text]
    assert holding == [0], holding
    assert lanes[0].count("tests/test_gpu.py:") == 3


@pytest.mark.parametrize(("gpu_mib", "lanes"), [(143771, 4), (81559, 2), (30000, 1)])
def test_no_more_ranks_on_a_gpu_than_fit_its_memory(tmp_path, gpu_mib, lanes):
    """4 lanes of N = 8 asked: 32 ranks fit an H200 (141 GB), 16 an H100 (80 GB; 24 ran it
    out of memory), and a GPU too small for 2 lanes still runs one."""
    done = _dry_run(tmp_path, "all", RANKS="2 8", RANKS_PARALLEL="4", RANKS_GPU_MIB=str(gpu_mib))
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(re.findall(r"^-- lane \d+ ", done.stdout, flags=re.M)) == lanes
    if lanes < 4:
        said = f"RANKS_PARALLEL=4: {lanes} lane(s), so that each of the {8 * lanes} ranks"
        assert said in done.stdout
    items = ITEM.findall(done.stdout)
    assert len(items) == len(set(items)) and {int(n) for n, *_ in items} == {2, 8}


def test_a_lane_count_that_is_not_a_count_is_refused(tmp_path):
    done = _dry_run(tmp_path, RANKS_PARALLEL="two")
    assert done.returncode == 2
    assert "RANKS_PARALLEL must be a count of lanes, got 'two'" in done.stdout


def test_flag_gemm_specs_name_shape_blocks_and_order(tmp_path):
    """flaggemm's M,K,N:blocks[:order] reach the tool as its arguments; no order: none."""
    specs = ["8192,4096,768:8", "8192,8192,2560:4:1,0,3,2"]
    done = _dry_run(tmp_path, *specs, mode="flaggemm", FLAG_S="0.2")
    assert done.returncode == 0, done.stdout + done.stderr
    runs = re.findall(r"build/dev/flag_gemm (.*?)  >>", done.stdout)
    assert runs == [r"8192\,4096\,768 8 0.2 all", r"8192\,8192\,2560 4 0.2 all 1\,0\,3\,2"], runs
    # no specs: the all-gather projections of solo's list, at tp 4 and 8
    done = _dry_run(tmp_path, mode="flaggemm", FLAG_S="0.2")
    runs = re.findall(r"build/dev/flag_gemm (.*?)  >>", done.stdout)
    assert len(runs) == 8 and r"8192\,4096\,768 8 0.2 all" in runs, runs


def test_paced_gemm_specs_name_shape_tp_rank_and_rates(tmp_path):
    """paced's M,K,N:tp[:rank] reach the tool at every rate of PACED_GBPS; no rank: tp/2."""
    specs = ["8192,4096,768:8", "8192,8192,2560:4:1"]
    done = _dry_run(tmp_path, *specs, mode="paced", PACED_S="0.2", PACED_GBPS="270 400")
    assert done.returncode == 0, done.stdout + done.stderr
    runs = re.findall(r"build/dev/paced_gemm (.*?)  >>", done.stdout)
    assert runs == [
        r"8192\,4096\,768 8 4 270 0.2 all 0",
        r"8192\,8192\,2560 4 1 270 0.2 all 0",
        r"8192\,4096\,768 8 4 400 0.2 all 0",
        r"8192\,8192\,2560 4 1 400 0.2 all 0",
    ], runs
    # no specs: the all-gather projections of solo's list, at tp 4 and 8, rank tp/2
    done = _dry_run(tmp_path, mode="paced", PACED_S="0.2")
    runs = re.findall(r"build/dev/paced_gemm (.*?)  >>", done.stdout)
    assert len(runs) == 8 and r"8192\,4096\,768 8 4 270 0.2 all 0" in runs, runs


def test_solo_paces_the_reduce_scatters_partials_only(tmp_path):
    """SOLO_GBPS reaches the tool as its link rate for the RS projections; the AG ones get 0
    (the tool refuses a rate for them)."""
    done = _dry_run(
        tmp_path, mode="solo", SOLO_TP="8", SOLO_S="0.2", SOLO_FOLDS="-1", SOLO_GBPS="270"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = re.findall(r"build/dev/solo_schedule (.*?)  >>", done.stdout)
    assert r"rs 8 1024\,512\,4096 0.2 -1 steps 2048 270" in runs, runs
    assert r"ag 8 1024\,4096\,768 0.2 -1 steps 2048 0" in runs, runs
    assert len(runs) == 8, runs


@pytest.mark.slow
def test_a_failed_item_keeps_its_rank_logs_and_the_kernels_gpu_lines(tmp_path):
    """Run for real (no GPU needed): an item whose file does not exist fails at both ranks.
    Every rank's log comes back as one archive in $OUT, and the failed step prints the kernel
    log's GPU lines that appeared since the script started (a fake dmesg: one line at the
    start, then an Xid among others), which say which engine and process faulted."""
    fake = tmp_path / "bin"
    fake.mkdir()
    seen = tmp_path / "dmesg_seen"
    xid = "NVRM: Xid (PCI:0000:19:00): 31, pid=7, name=python3, MMU Fault: ENGINE CE3"
    (fake / "dmesg").write_text(
        f'#!/bin/sh\necho "boot line"\n[ -f "{seen}" ] && printf "%s\\nunrelated\\n" "{xid}"\n'
        f'touch "{seen}"\n'
    )
    (fake / "dmesg").chmod(0o755)
    out = tmp_path / "out"
    done = _device_run(
        out,
        dry=False,
        PATH=f"{fake}{os.pathsep}{os.environ['PATH']}",
        NO_BUILD="1",
        RANKS="2",
        RANKS_FILES="test_no_such_file.py:60",
        JAX_UB_TEST_RANKS_MPS="0",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"kernel log: {xid}" in done.stdout, done.stdout
    assert "kernel log: boot line" not in done.stdout and "unrelated" not in done.stdout
    with tarfile.open(out / "ranks_failed_2_test_no_such_file.tgz") as archive:
        names = archive.getnames()
    assert {"ranks_2_test_no_such_file/rank0.log", "ranks_2_test_no_such_file/rank1.log"} <= set(
        names
    ), names


def test_the_check_runs_every_n_then_the_gemm_cache_and_faults_and_packs_its_logs(tmp_path):
    """`check` (a commit's GPU check in one device call): the quick set at N = 2, 4, 8, the
    GEMM cache's tests, the shared-GPU fault tests (the timeout path); the GEMM table only with
    CHECK_TABLE; with PACK, $OUT holds one archive of every log, the loose files removed (the
    device's copy-back takes few files)."""
    out = tmp_path / "out"
    done = _dry_run(out, mode="check", PACK="logs", RANKS_GPU_MIB="140000")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {n for n, _, _, _ in ITEM.findall(done.stdout)} == {"2", "4", "8"}, done.stdout
    assert "tests/test_gpu_gemm_cache.py" in done.stdout
    faults = re.search(r"faults\): timeout -k 10 240 .*multiprocess.py (.*) >", done.stdout)
    wanted = r"-k killed_process\ or\ faults_on_one_shared_gpu"  # as printf %q prints it
    assert faults and wanted in faults.group(1), done.stdout
    assert "gemm_table.py" not in done.stdout
    assert [p.name for p in out.iterdir()] == ["logs.tgz"]
    with tarfile.open(out / "logs.tgz") as archive:
        names = set(archive.getnames())
    assert {"gpus.txt", "gemm_cache.log", "faults.log"} <= names, names
    assert any(n.startswith("ranks_lane") for n in names), names

    table = _dry_run(
        tmp_path / "t", mode="check", CHECK_TABLE="--models 8b --tp 8", RANKS_GPU_MIB="140000"
    )
    assert re.search(
        r"gemm table: timeout -k 10 200 .*gemm_table.py --models 8b --tp 8 +>", table.stdout
    ), table.stdout
    assert "tuning_trace.py" in table.stdout


def test_the_table_mode_passes_its_args_and_reads_the_tunings(tmp_path):
    """`table`: benchmarks/gemm_table.py with the args given, traced (less every op call's
    lines), under TABLE_S, its log named by TAG; then tuning_trace.py reads that log."""
    done = _dry_run(
        tmp_path, "--models", "70b", "--tp", "4,8", mode="table", TABLE_S="321", TAG="t70"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    step = re.search(r"gemm table: timeout -k 10 (\d+) .*gemm_table.py (.*) > (\S+)", done.stdout)
    assert step, done.stdout
    assert step.group(1) == "321" and shlex.split(step.group(2)) == [
        "--models",
        "70b",
        "--tp",
        "4,8",
    ]
    assert step.group(3).endswith("t70.log"), step.group(3)
    assert "grep --line-buffered -vE" in step.group(0) and "(begins|enqueued)" in step.group(0)
    assert re.search(r"tuning_trace.py \S*t70.log", done.stdout), done.stdout
