""".ci/gpu: the wheel set's selection and checks (.ci/gpu/wheelset.py) and run.sh's steps in a
dry run, whose commands name options the tools have."""

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.jobs import Job, child_env, finish_soon

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("wheelset", REPO / ".ci" / "gpu" / "wheelset.py")
wheelset = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelset)


def meta(name, version, *needs):
    return {"name": name, "version": version, "requires_dist": list(needs)}


def test_select_stops_at_image_packages_and_follows_markers_and_extras():
    report = {
        "apache-beam": meta(
            "apache-beam",
            "2.77.0",
            "numpy<2.5",
            "fasteners>=0.3",
            "pytz; python_version >= '3.12'",
            "oldthing; python_version < '3.10'",
            "google-cloud; extra == 'gcp'",
        ),
        "numpy": meta("numpy", "2.4.6"),
        "fasteners": meta("fasteners", "0.20"),
        "pytz": meta("pytz", "2026.6"),
        # an image package at a newer release than the image's: its needs are not carried
        "huggingface-hub": meta("huggingface_hub", "2.4.0", "httpx2"),
        "httpx2": meta("httpx2", "2.16.2"),
        "datasets": meta("datasets", "5.2.0", "huggingface-hub>=1.31", "dill<0.4.2"),
        "dill": meta("dill", "0.4.1"),
        "pydantic": meta("pydantic", "2.14.3", "email-validator; extra == 'email'"),
        "email-validator": meta("email_validator", "2.0"),
    }
    image = {"numpy", "huggingface-hub"}
    top = ["apache-beam>=2.60", "datasets>=3.0", "numpy>=1.24", "pydantic[email]"]
    assert wheelset.select(report, image, top) == {
        "apache-beam": "2.77.0",
        "fasteners": "0.20",
        "pytz": "2026.6",
        "datasets": "5.2.0",
        "dill": "0.4.1",
        "pydantic": "2.14.3",
        "email-validator": "2.0",
    }


def test_select_fails_on_a_requirement_the_report_lacks():
    with pytest.raises(SystemExit, match="fasteners>=0.3 is not in the resolver's report"):
        wheelset.select({"a": meta("a", "1", "fasteners>=0.3")}, set(), ["a"])


def test_check_reports_duplicates_shadowing_and_known_version_conflicts(tmp_path, capsys):
    for name, version, needs in [
        ("beam", "1.0", ["numpy<2.5"]),
        ("dill", "0.4.0", []),
        ("dill", "0.4.1", []),
        ("numpy", "2.4.6", []),
    ]:
        dist = f"{name}-{version}"
        with zipfile.ZipFile(tmp_path / f"{dist}-py3-none-any.whl", "w") as z:
            lines = [f"Name: {name}", f"Version: {version}"] + [
                f"Requires-Dist: {x}" for x in needs
            ]
            z.writestr(f"{dist}.dist-info/METADATA", "\n".join(lines) + "\n\nbody\n")
    assert wheelset.check(tmp_path, {"numpy"}, {"numpy": "2.5.2"}) == 1
    out = capsys.readouterr().out
    assert "error: dill comes 2 times" in out
    assert "error: numpy-2.4.6-py3-none-any.whl shadows the image's numpy" in out
    assert "note: beam 1.0 asks numpy<2.5; the image has 2.5.2" in out


def test_stub_wheel_installs_with_pip(tmp_path):
    stub = wheelset.write_stub(tmp_path, "Typing_Extensions", "4.16.0")
    assert stub.name == "typing_extensions-4.16.0-py3-none-any.whl"
    assert wheelset.wheel_metadata(stub) == ("Typing_Extensions", "4.16.0", [])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(tmp_path / "t"),
            stub,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "t" / "typing_extensions-4.16.0.dist-info" / "METADATA").is_file()


def test_project_requirements_are_setup_cfgs():
    reqs = wheelset.project_requirements()
    assert any(r.startswith("apache-beam") for r in reqs)  # the pipeline extra: datasets built
    assert not any(r.startswith("apache-beam[") for r in reqs)  # no boto3: 64 MiB per call
    assert any(r.startswith("deepspeed") for r in reqs)
    assert not any(r.startswith("#") or r.startswith("pytest") for r in reqs)


def dry_run(call: str, out: Path, *args: str) -> list[tuple[int, str]]:
    """(box seconds, command) of each step `GPU_DRY=1 .ci/gpu/run.sh CALL` lists."""
    env = {**os.environ, "GPU_DRY": "1", "OUT": str(out)}
    done = subprocess.run(
        ["bash", ".ci/gpu/run.sh", call, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.findall(r"^\+ \[(\d+) s\] (.*)$", done.stdout, re.M)
    return [(int(box), command) for box, command in steps]


@pytest.mark.parametrize("call", ["kernels", "bench", "jobs", "science", "host", "measure", "all"])
def test_each_call_fits_ten_minutes_with_tests_timed_out_inside_their_box(tmp_path, call):
    steps = dry_run(call, tmp_path, "-k", "x")
    assert sum(box for box, _ in steps) <= 540, steps
    assert steps[0][1].endswith("--env-step"), steps
    for box, command in steps:
        timeout = re.search(r"--timeout (\d+)", command)
        assert timeout is None or int(timeout.group(1)) < box, (box, command)
        assert " -x " not in command  # every test runs
        tool = re.search(r"tools/((?:bench/)?\w+)\.py", command)
        if tool:  # options the tool has
            source = (REPO / "tools" / f"{tool.group(1)}.py").read_text()
            for option in re.findall(r" (--[a-z-]+)", command):
                assert f'"{option}"' in source, (tool.group(1), option)
    assert (tmp_path / "summary.txt").read_text().count("dry run") == len(steps)


def test_all_runs_the_rare_slot_s_priorities_in_order(tmp_path):
    """The paper's base-shape kernels first, then bench_kernel, the whole-step benchmarks,
    and the DeepSpeed jobs last (in parallel, as the kernel tests)."""
    commands = [command for _, command in dry_run("all", tmp_path)]
    order = ["--env-step", "-k base_shape", "bench_kernel", "bench_model", "bench_train", "jobs"]
    assert [next(i for i, c in enumerate(commands) if k in c) for k in order] == list(range(6))
    assert " -n " in commands[1] and " -n " in commands[5]
    kernels = [command for _, command in dry_run("kernels", tmp_path)]
    assert "base_shape" in kernels[1] and "not base_shape" in kernels[2]


def test_an_unknown_call_is_refused(tmp_path):
    bad = subprocess.run(
        ["bash", ".ci/gpu/run.sh", "benchmarks"],
        cwd=REPO,
        env={**os.environ, "GPU_DRY": "1", "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown call 'benchmarks'" in bad.stderr


def test_the_lane_s_table_lists_every_test_with_its_result_and_seconds(tmp_path):
    """A real pytest run (a pass, a failure, a skip, a hang cut by its --timeout) through the
    lane's options, its junit XML through .ci/gpu/junit_table.py."""
    (tmp_path / "test_lane.py").write_text(
        "import time, pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "def test_hangs():\n    time.sleep(60)\n"
        "@pytest.mark.skip(reason='no GPU')\ndef test_skipped():\n    pass\n"
    )
    xml = tmp_path / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "3"]
    cmd += ["--junitxml", str(xml), "-o", "junit_family=xunit1", "test_lane.py"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout  # every test ran: no -x
    table = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "gpu" / "junit_table.py"), str(xml)],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:6]}
    assert {name.split("::")[-1]: row[0] for name, row in rows.items()} == {
        "test_ok": "pass",
        "test_bad": "FAIL",
        "test_hangs": "FAIL",
        "test_skipped": "skip",
    }, table
    assert 2.5 < float(rows["test_lane::test_hangs"][1]) < 30, table
    assert "1 pass, 2 FAIL, 1 skip" in table
    assert "test_lane::test_bad: AssertionError: one is not two" in table, table
    assert "test_lane::test_hangs: Failed: Timeout" in table, table


def test_a_child_job_keeps_the_caller_s_pythonpath(tmp_path, monkeypatch):
    """The GPU lane carries its packages on PYTHONPATH (/tmp/site): a job the tests start (the
    deepspeed launcher, its ranks, finetune) must still import them beside the checkout."""
    carried = tmp_path / "site"
    (carried / "carried_probe").mkdir(parents=True)
    (carried / "carried_probe" / "__init__.py").write_text("NAME = 'carried'\n")
    monkeypatch.setenv("PYTHONPATH", str(carried))
    probe = "import carried_probe, shatter; print(carried_probe.NAME, shatter.__file__)"
    job = Job([sys.executable, "-c", probe])
    text = finish_soon(job, timeout=60)
    assert text.startswith("carried ") and str(REPO / "shatter") in text, text
    assert child_env({"PYTHONPATH": "a:b"}, X="1") == {"PYTHONPATH": f"{REPO}:a:b", "X": "1"}


def test_a_job_cut_by_its_test_s_timeout_ends_with_the_test(tmp_path):
    """pytest-timeout ends a test mid-job: the job's process group (its own session, where the
    deepspeed launcher's ranks live) ends with it, not after the lane's step."""
    (tmp_path / "test_cut.py").write_text(
        "import sys, time\n"
        "from tests.jobs import Job, jobs_end_with_their_test\n"
        "def test_cut():\n"
        f"    job = Job([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(tmp_path / 'pid')!r}, 'w').write(str(job.proc.pid))\n"
        "    time.sleep(60)\n"
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "3"]
    cmd += ["--rootdir", str(REPO), "-c", str(REPO / "setup.cfg"), str(tmp_path / "test_cut.py")]
    done = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert done.returncode == 1 and "Timeout" in done.stdout, done.stdout[-2000:]
    pid = int((tmp_path / "pid").read_text())
    assert (
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )
