"""experiments.long_context in a fresh process (it forces 8 devices): parts b and c.
(Part a's exactness is checked in test_context, part d's combinations in test_compare.)"""
import json

import pytest

from conftest import run_python


@pytest.mark.slow
def test_attention_memory_falls_with_cp_and_exercise_8(tmp_path):
    r = run_python("import runpy, sys; sys.argv[0] = 'x'; "
                   "runpy.run_module('experiments.long_context', run_name='__main__')",
                   "--parts", "bc", "--out", str(tmp_path), "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    memory = {int(cp): v for cp, v in res["b"].items()}
    for cp in (2, 4, 8):  # at least 1/cp: each device keeps T/cp of the queries' scores
        assert memory[cp] * cp <= memory[1]
    c = res["c"]
    assert len({v["flops_per_device"] for v in c.values()}) == 1  # the same 1/8 of the work
    assert set(c["zero3 dp=8"]["sent"]) == {"all-gather", "reduce-scatter"}  # parameters
    assert set(c["tp=8"]["sent"]) == {"all-reduce"}  # activations
    sp = c["tp=8 + sp"]["sent"]
    assert sp["all-gather"] + sp["reduce-scatter"] == c["tp=8"]["sent"]["all-reduce"]
    assert c["tp=8 + sp"]["temporaries"] < c["tp=8"]["temporaries"]
    assert c["tp=8 + sp + selective"]["temporaries"] < c["tp=8 + sp"]["temporaries"]
    assert c["tp=8 + sp + selective"]["sent"] == sp  # selective recomputes, never resends
    kept = [c[k]["residuals_per_layer"] for k in ("tp=8", "tp=8 + sp", "tp=8 + sp + selective")]
    assert kept[0] > kept[1] > kept[2]  # measured per device: sp splits, selective drops maps
    formula = [c[k]["korthikanti_per_layer"] for k in ("tp=8", "tp=8 + sp")]
    assert formula[1] * 15 == formula[0] * 8  # tiny8 at tp=8: (4 + 12/8 + 2) vs (2 + 2) sbh
