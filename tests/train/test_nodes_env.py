"""Settings that must reach every node: a two-"node" launch through the deepspeed launcher's pdsh
path, where a stand-in `pdsh` (first on PATH) records its command and runs it once per host on
this machine: on the first host with this environment (its shell profile sets the store's
settings), on the other without AWS_*, HF_* and TMPDIR, as that node's own shell would be."""

import json
import os
import sys

import pytest

from tests.jobs import child_env, free_port, run_command
from tests.train.runs import BIN, SCRIPT, cheap_config

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

PDSH = f"""#!{sys.executable}
import json, os, subprocess, sys
args = sys.argv[1:]
hosts = args[args.index("-w") + 1].split(",")
command = " ".join(args[args.index("-w") + 2:])
with open(os.environ["PDSH_RECORD"], "a") as f:
    f.write(json.dumps({{"hosts": hosts, "command": command}}) + "\\n")
bare = {{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_")) and k != "TMPDIR"}}
jobs = [subprocess.Popen(["bash", "-c", command.replace("%n", str(n))], env=bare if n else None)
        for n in range(len(hosts))]
sys.exit(max(job.wait() for job in jobs))
"""


def test_the_store_settings_reach_every_node(books_data, tmp_path):
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "pdsh").write_text(PDSH)
    (stand_in / "pdsh").chmod(0o755)
    (tmp_path / "hosts").write_text("nodeA slots=1\nnodeB slots=1\n")
    launch = tmp_path / "launch"  # the launch directory: its .deepspeed_env
    launch.mkdir()
    env = child_env({k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_"))})
    env["PATH"] = f"{stand_in}:{os.environ['PATH']}"
    env.update(PDSH_RECORD=str(tmp_path / "pdsh.jsonl"), TMPDIR=str(tmp_path / "tmp"))
    env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_REGION="us-east-1")
    env.update(AWS_SECRET_ACCESS_KEY="not-written")
    (tmp_path / "tmp").mkdir()
    cmd = [str(BIN / "deepspeed"), "--hostfile", str(tmp_path / "hosts"), "--launcher", "pdsh"]
    cmd += ["--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd += [SCRIPT, "--data", str(books_data), "--output", str(tmp_path / "run")]
    cmd += ["--config", str(cheap_config(tmp_path / "tiny.yaml"))]  # its end: 16 validation rows
    cmd += ["--preset", "shatter-tiny", "--max-steps", "1", "--micro-batch", "2"]
    cmd += ["--num-workers", "0", "--eval-every", "0", "--no-progress"]

    first = run_command(cmd, timeout=240, env=env, cwd=launch)
    assert first.returncode != 0
    line = next(x for x in first.stderr.splitlines() if "set for rank(s) 0" in x)
    assert "AWS_ENDPOINT_URL, AWS_REGION, AWS_SECRET_ACCESS_KEY, TMPDIR set for rank(s) 0" in line
    assert "not for rank(s) 1" in line and "then launch again" in line, line
    assert "add AWS_SECRET_ACCESS_KEY there" in line and "Traceback" not in first.stderr
    written = (launch / ".deepspeed_env").read_text()
    assert "AWS_ENDPOINT_URL=http://127.0.0.1:9\n" in written and "TMPDIR=" in written
    assert "SECRET" not in written and (launch / ".deepspeed_env").stat().st_mode & 0o077 == 0

    env.pop("AWS_SECRET_ACCESS_KEY")  # an instance role's node: no key in the environment
    second = run_command(cmd, timeout=240, env=env, cwd=launch)
    assert second.returncode == 0, second.stderr[-3000:]
    recorded = [json.loads(x) for x in (tmp_path / "pdsh.jsonl").read_text().splitlines()]
    assert len(recorded) == 2 and recorded[0]["hosts"] == ["nodeA", "nodeB"]
    assert "export AWS_ENDPOINT_URL" not in recorded[0]["command"]
    assert "export AWS_ENDPOINT_URL=http://127.0.0.1:9" in recorded[1]["command"]
    assert f"export TMPDIR={tmp_path / 'tmp'}" in recorded[1]["command"]


def test_no_credential_is_written_to_the_launchers_env_file(tmp_path):
    """.deepspeed_env's lines end up on pdsh's ssh command line: no secret of any name."""
    from shatter.train.node_env import add_to_env_file

    settings = {
        "AWS_ENDPOINT_URL": "http://store:9000",
        "AWS_SHARED_CREDENTIALS_FILE": "/home/me/.aws/credentials",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_SESSION_TOKEN": "t",
        "AWS_SECURITY_TOKEN": "t",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN": "a",
        "HF_TOKEN": "h",
        "HF_HUB_TOKEN_PATH": "/x",
    }
    path = tmp_path / ".deepspeed_env"
    written = add_to_env_file(path, settings)
    assert written == ["AWS_ENDPOINT_URL", "AWS_SHARED_CREDENTIALS_FILE"]
    assert path.read_text().count("=") == 2 and (path.stat().st_mode & 0o777) == 0o600
