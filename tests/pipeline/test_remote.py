"""What remote Beam workers get: `--setup_file ./setup.py` stages this package with the core
dependencies only (no torch, no deepspeed), through Beam's own stager, as Dataflow does."""

import re
import tarfile
from pathlib import Path

from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.stager import Stager

REPO = Path(__file__).resolve().parents[2]


def test_setup_file_stages_the_pipeline_without_the_training_stack(tmp_path):
    Stager.create_job_resources(
        PipelineOptions(["--setup_file", str(REPO / "setup.py")]), str(tmp_path)
    )
    (sdist,) = tmp_path.glob("shatter_toolkit-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        info = tar.extractfile(next(n for n in names if n.endswith("/PKG-INFO"))).read().decode()
    assert any(n.endswith("pipeline/transforms.py") for n in names)
    core = set(re.findall(r"^Requires-Dist: ([\w-]+)[^;\n]*$", info, re.M))  # no `; extra == ...`
    assert {"sentencepiece", "pyarrow", "mwparserfromhell", "fsspec"} <= core
    assert not core & {"torch", "deepspeed", "datasets"}  # a worker's image brings its Beam
    assert "apache-beam" in re.findall(r"^Requires-Dist: ([\w-]+).*extra == .pipeline.", info, re.M)
