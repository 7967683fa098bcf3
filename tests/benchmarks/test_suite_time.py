"""benchmarks/suite_time.py's accounting, on hand-made inputs: the compile seconds JAX
stores in a cache entry, the distinct training steps' floor, and where a run's
test-seconds went by test (conftest's record by test joined with pytest's junit)."""
import json
import zlib

from benchmarks import suite_time

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.parallel.test_a" name="test_layout[dp2]" time="12.5"/>
<testcase classname="tests.parallel.test_a" name="test_refused" time="0.25"/>
<testcase classname="tests.cli.test_b" name="test_in_a_subprocess" time="30.0"/>
</testsuite></testsuites>"""


def entry(folder, name, seconds):
    """A persistent-cache entry as JAX writes it: zlib over the seconds (4 bytes,
    big-endian), then the executable."""
    path = folder / f"{name}-cache"
    path.write_bytes(zlib.compress(seconds.to_bytes(4, "big") + b"executable"))
    return path


def test_the_stored_seconds_and_the_training_steps_floor(tmp_path):
    cache = tmp_path / ".cache" / "jax-tests"
    cache.mkdir(parents=True)
    assert suite_time.compile_seconds(entry(cache, "jit_step-0a", 4)) == 4
    entry(cache, "jit_step-1b", 3)
    entry(cache, "jit__multi_slice-2c", 0)
    (cache / "jit_step-3d-cache").write_bytes(b"not compressed")  # unreadable: left out
    got = suite_time.programs(tmp_path)
    assert got["distinct_programs"] == 4 and got["distinct_train_steps"] == 3
    assert got["distinct_compile_s_at_least"] == 7
    assert got["distinct_train_steps_compile_s_at_least"] == 7
    assert got["distinct_programs_over_1s"] == 2


def test_the_test_seconds_split_by_test(tmp_path):
    record = tmp_path / ".cache" / "suite-compiles" / "by-test"
    record.mkdir(parents=True)
    (record / "gw0.json").write_text(json.dumps({
        "tests/parallel/test_a.py::test_layout[dp2]":
            {"compiles": 3, "compile_or_load_s": 9.5, "trace_s": 0.4},
        "tests/parallel/test_a.py::test_refused":
            {"compiles": 0, "compile_or_load_s": 0.0, "trace_s": 0.0}}))
    (record / "gw1.json").write_text(json.dumps({
        "tests/cli/test_b.py::test_in_a_subprocess":
            {"compiles": 0, "compile_or_load_s": 0.0, "trace_s": 0.0}}))
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    got = suite_time.by_test(tmp_path, junit, top=2)
    assert got["test_s"] == 42.8
    assert got["in_process_compile_or_load_s"] == 9.5
    # the test that compiled nothing itself: the quick refusal and the subprocess's test
    assert got["tests_compiling_nothing_in_process_s"] == 30.2
    assert [t["test"] for t in got["slowest"]] == ["tests/cli/test_b.py::test_in_a_subprocess",
                                                   "tests/parallel/test_a.py::test_layout[dp2]"]
    assert got["slowest"][1] == {"test": "tests/parallel/test_a.py::test_layout[dp2]",
                                 "s": 12.5, "compile_or_load_s": 9.5, "compiles": 3}
