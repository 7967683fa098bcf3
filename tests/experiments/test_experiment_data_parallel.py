"""experiments.data_parallel in a fresh process (it forces its own 8 devices)."""
import json

import numpy as np
import pytest

from conftest import run_python


@pytest.mark.slow
def test_ring_walkthrough_bytes_times_and_accumulation(tmp_path):
    r = run_python("import runpy, sys; sys.argv[0] = 'x'; "
                   "runpy.run_module('experiments.data_parallel', run_name='__main__')",
                   "--parts", "cdef", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    c = res["c"]
    assert c["result"] == np.arange(32).reshape(4, 8).sum(0).tolist()
    for row in c["bytes"]:
        assert row["ring_sent_per_device"] == row["ring_formula"]
        assert row["server_sent_plus_received"] == row["server_formula"]
    eth = [x for x in res["d"]["rows"] if x["K"] == 8 and x["link"] == "ethernet"][0]
    assert 19 < eth["ring_seconds"] < 21  # the lecture's "twenty seconds a step"
    assert all(x["max_rel_grad_diff"] <= 1e-5 for x in res["e"]["accumulation"])
    assert abs(res["e"]["trap"]["difference"]) > 1e-3
    assert res["f"]["agree"] and res["f"]["hlo_grad_allreduce_bytes"] == res["f"]["predicted"]["payload_bytes"]
