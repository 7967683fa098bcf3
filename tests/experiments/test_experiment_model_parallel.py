"""experiments.model_parallel in a fresh process (it forces 8 devices): parts a, b, d, e.
(Parts c and f, the pipelines and 3-D, are checked in test_pipeline.)"""
import json

import pytest

from conftest import run_python


@pytest.mark.slow
def test_tensor_parallel_schedules_and_the_communication_table(tmp_path):
    r = run_python("import runpy, sys; sys.argv[0] = 'x'; "
                   "runpy.run_module('experiments.model_parallel', run_name='__main__')",
                   "--parts", "abde", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for k in ("2", "4", "8"):
        assert res["a"][k]["max_abs_diff"] <= 1e-5
        assert res["a"][k]["bytes_per_device"] * int(k) == res["a"][k]["whole_bytes"]
        assert res["b"][k]["max_abs_diff"] <= 1e-5
    assert res["a"]["wrong_split_max_abs_diff"] > 1e-2 * res["a"]["output_scale"]
    for s in res["d"]["schedules"].values():
        assert s["idle_simulated"] == s["idle_formula"]
    assert res["d"]["schedules"]["gpipe"]["peak_in_flight"] == [4, 4, 4, 4]
    assert res["d"]["schedules"]["1f1b"]["peak_in_flight"] == [4, 3, 2, 1]
    assert res["d"]["exercise_3"] == {"4": 27, "8": 63}
    e = res["e"]
    assert round(e["tp"]["payload_bytes_per_step"] / 1e9, 1) == 17.2
    assert round(e["tp"]["allreduce_bytes"] / 1e6) == 134
    assert round(e["pp"]["boundary_bytes_per_step"] / 1e6) == 268
    assert (tmp_path / "schedule_1f1b.png").stat().st_size > 1000
