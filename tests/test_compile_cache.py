"""torch.compile's caches and the zenflow backend: a compiled graph from the cache is one the
passes would have produced here, its gradients going to the same weights."""

import json
import shutil
from pathlib import Path

import zenflow
from tests.python_process import stdout_of
from zenflow.compile.backend import rewrite_digest


def train_in_a_fresh_process(cache_dir: Path, *args: str) -> dict:
    out = stdout_of(
        ["-m", "tests.compile_cache_worker", *args],
        timeout_s=600,
        TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
    )
    return json.loads(out.strip().splitlines()[-1])


def test_a_cached_compile_is_reused_only_for_the_same_weight_slots(tmp_path):
    first = train_in_a_fresh_process(tmp_path)
    again = train_in_a_fresh_process(tmp_path)
    moved = train_in_a_fresh_process(tmp_path, "--bystander")
    assert (first["hits"], first["misses"]) == (0, 1)
    assert (again["hits"], again["misses"]) == (1, 0)  # the passes did not run again
    # Other slots: a graph compiled for the first run's would train the bystander instead.
    assert (moved["hits"], moved["misses"]) == (0, 1)
    assert moved["bystander_untouched"]
    assert again["weights"] == first["weights"] == moved["weights"]


def test_the_cache_key_changes_with_the_rewriting_code_only(tmp_path):
    package = Path(zenflow.__file__).resolve().parent
    copy = tmp_path / "zenflow"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    compiler = copy / "compile"
    before = rewrite_digest(compiler)
    (copy / "runtime" / "conductor.py").write_text("# runs the ops; rewrites nothing\n")
    assert rewrite_digest.__wrapped__(compiler) == before
    (compiler / "passes" / "column_split.py").write_text("# another rewrite\n")
    assert rewrite_digest.__wrapped__(compiler) != before
