"""experiments.moe in a fresh process (it forces 4 devices): every part."""
import json

import pytest

from conftest import run_python


@pytest.mark.slow
def test_balance_capacity_bytes_and_the_dense_peer(tmp_path):
    r = run_python("import runpy, sys; sys.argv[0] = 'x'; "
                   "runpy.run_module('experiments.moe', run_name='__main__')",
                   "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    a = {row["router"]: row for row in res["a"]["rows"]}
    # the load-balancing loss keeps the busiest expert nearer the mean than no loss does
    assert a["aux"]["mean of last 5"] < a["no aux"]["mean of last 5"]
    assert a["aux"]["load max/mean first"] == a["no aux"]["load max/mean first"]  # same start
    dropped = [row["dropped, mean of last 5"] for row in res["b"]["rows"]]
    assert dropped[0] > dropped[1] > dropped[2] == 0.0  # capacity 0.5, 1, dropless
    c = {row["layout"]: row for row in res["c"]["rows"]}
    assert all(row["agree"] for row in c.values())  # every collective's bytes as predicted
    assert c["ep=4"]["all-to-all B"] > 0 == c["dp=4"]["all-to-all B"]
    d = {row["model"]: row for row in res["d"]["rows"]}
    # the same active parameters but for the router (2 layers x 32 x 8)
    assert d["tiny-moe"]["active per token"] - d["dense, same active"]["parameters"] == 512
    assert (tmp_path / "a_balance.png").exists()
