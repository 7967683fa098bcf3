"""experiments.data: each part's figures are what they claim, on small sizes (seconds; the
full-size run is `python -m experiments.data`, and the `slow` test below)."""
import json
import math

import numpy as np
import pytest

from experiments import data as D
from jaxscale.data.lsh_params import candidate_probability, optimal_params
from jaxscale.data.lsh_scurve import SCurveRow
from jaxscale.data.shingles import jaccard, shingle_set
from jaxscale.garden import make_corpus
from jaxscale.garden.language import score_document


@pytest.fixture
def lab():
    return D.Lab(seed=0)


def test_known_pair_has_the_jaccard_it_is_built_for():
    a, b = D.known_pair()
    sa, sb = shingle_set(a), shingle_set(b)
    assert (len(sa & sb), len(sa | sb)) == (80, 140)
    assert jaccard(sa, sb) == 80 / 140
    a, b = D.known_pair(10, 5, 3)
    assert jaccard(shingle_set(a), shingle_set(b)) == 10 / 18


@pytest.mark.slow
def test_part_a_std_follows_the_formula(lab, tmp_path, monkeypatch):
    monkeypatch.setattr(D, "K_VALUES", (16, 256))
    monkeypatch.setattr(D, "SHA1_K", 16)
    res = D.part_a(lab, tmp_path)
    assert res["jaccard"] == pytest.approx(4 / 7)
    assert [r["k"] for r in res["rows"]] == [16, 256]
    for r in res["rows"] + [res["sha1"]]:
        assert r["seeds"] == D.SEEDS == len(r["estimates"])
        assert r["formula_std"] == pytest.approx(math.sqrt(4 / 7 * 3 / 7 / r["k"]))
        assert r["std"] == pytest.approx(np.std(r["estimates"], ddof=1))
        assert 0.5 < r["ratio"] < 2.0  # 20 seeds: the std is known to ~16%
        assert abs(r["mean_off_in_se"]) < 4
        # every estimate is a count of agreeing minima out of k
        assert all(float(e * r["k"]).is_integer() for e in r["estimates"])
    # the spread shrinks with k, as 1/sqrt(k) says (16x the permutations: 4x smaller)
    assert res["rows"][0]["std"] / res["rows"][1]["std"] == pytest.approx(4, rel=0.5)
    assert abs(res["sha1_vs_fast_mean_z"]) < 4
    assert (tmp_path / "minhash_std.png").exists()


def test_part_b_lecture_points_and_measured_rates(lab, tmp_path, monkeypatch):
    monkeypatch.setattr(D, "S_CURVE_WEB", 400)
    monkeypatch.setattr(D, "RANDOM_PAIRS", 200)
    res = D.part_b(lab, tmp_path)
    assert [f"{x['p']:.3f}" for x in res["lecture"]] == ["0.047", "0.470", "0.975"]
    assert res["pairs"]["recorded_vs_exact_max_diff"] < 1e-12
    (b20, pipeline) = res["curves"]
    assert (b20["bands"], b20["rows"], b20["k"]) == (20, 5, 100)
    assert (pipeline["bands"], pipeline["rows"]) == optimal_params(0.7, 128)
    n_pairs = res["pairs"]["derived_pairs"] + res["pairs"]["random_pairs"]
    for c in res["curves"]:
        assert sum(x["pairs"] for x in c["bins"]) == n_pairs
        for x in c["bins"]:
            if x["pairs"]:
                assert x["lo"] <= x["mean_jaccard"] <= x["hi"]
                assert x["formula_at_mean"] == pytest.approx(candidate_probability(
                    x["mean_jaccard"], c["bands"], c["rows"]))
                assert abs(x["sigmas"]) < 4  # measured within 4 stated standard errors
        # the curve rises: the top bin is caught, the bottom one is not
        full = [x for x in c["bins"] if x["pairs"]]
        assert full[0]["measured"] < 0.05 and full[-1]["measured"] > 0.95
    assert (tmp_path / "s_curve.png").exists()


def test_sigmas_of_a_bin_without_spread():
    row = SCurveRow(0.9, 1.0, 5, 1.0, 1.0, 1.0, 0.0)
    assert D.sigmas(row) == 0.0
    assert D.sigmas(row._replace(measured=0.8)) == math.inf
    assert D.sigmas(row._replace(measured=0.8, stderr=0.1)) == pytest.approx(-2.0)


def test_bin_means_bin_as_s_curve_does():
    # bins [0, 0.5) and [0.5, 1.0]: 0.5 opens the second, 1.0 closes it
    means = D.bin_means(np.array([0.1, 0.5, 0.7, 1.0]), np.array([0.0, 0.5, 1.0]))
    assert means == pytest.approx([0.1, (0.5 + 0.7 + 1.0) / 3])
    assert np.isnan(D.bin_means(np.array([0.7]), np.array([0.0, 0.5, 1.0]))[0])


def test_part_c_counts_add_up(lab, tmp_path, monkeypatch):
    monkeypatch.setattr(D, "FUNNEL_WEB", 1500)
    res = D.part_c(lab, tmp_path)
    stages = res["stages"]
    assert stages[0]["in"] == 1500
    for s, nxt in zip(stages, stages[1:]):
        assert s["in"] - s["removed"] == s["kept"] == nxt["in"]
    assert res["report"]["kept"] == stages[-1]["kept"] == 1500 - sum(s["removed"]
                                                                     for s in stages)
    assert res["dedup_pages"] == stages[2]["in"]  # what filters and decontamination left
    for name in ("filters", "decontamination", "clusters"):
        sc = res["scores"][name]
        assert sc["right"] <= min(sc["removed"], sc["should"])
    for x in res["pairs"]:
        for when in ("before", "after"):
            p = x[when]
            assert p["true"] == x["true_pairs"] and p["true_positives"] <= p["predicted"]
            assert p["precision"] == pytest.approx(p["true_positives"] / p["predicted"])
            assert p["recall"] == pytest.approx(p["true_positives"] / p["true"])
        assert x["before"]["predicted"] == x["candidates"]
        assert x["after"]["predicted"] == x["verified"] <= x["candidates"]
        # verification drops only pairs below the threshold: no true pair is lost
        assert x["after"]["true_positives"] == x["before"]["true_positives"]
        assert x["candidates_per_page"] == pytest.approx(x["candidates"] / x["pages"])
        assert (x["bands"], x["rows"]) == optimal_params(x["threshold"], 128)
    # verified pairs at the pipeline's threshold, clustered, keep what clean() kept
    assert res["same_pages_kept"] and res["removed_by_verified_pairs"] == res["removed_by_clean"]
    # the funnel: each bar is what the stage before it let through
    totals = [sum(c.values()) for _, c in res["funnel"]]
    assert totals[0] == 1500 and totals[-1] == res["report"]["kept"]
    assert totals == sorted(totals, reverse=True)
    assert (tmp_path / "funnel.png").exists()


def small_d(monkeypatch):
    for name, value in {"D_DOCS": 64, "D_REPEATED": 4, "D_COPIES": 6, "D_POOL": 400,
                        "D_VAL": 32, "D_STEPS": 3, "D_BATCH": 8, "D_WARMUP": 1}.items():
        monkeypatch.setattr(D, name, value)


def test_dedup_corpora_remove_the_planted_copies(monkeypatch):
    small_d(monkeypatch)
    c = D.dedup_corpora(0)
    assert len(c["duplicated"]) == len(c["deduplicated"]) == 64
    assert c["tokens"]["deduplicated"] == sum(len(d) - 1 for d in c["deduplicated"])
    assert c["topped_up"] == 64 - c["kept"] > 0
    assert c["copies"] == 24 and c["removed_copies"] == 24 - 4  # one of each kept
    dup = {tuple(d.tolist()) for d in c["duplicated"]}
    assert c["distinct"]["duplicated"] == len(dup) <= 64 - 20
    assert c["distinct"]["deduplicated"] == len(c["deduplicated"])  # no exact copy survives
    for doc in c["repeated"]:
        key = tuple(doc.tolist())
        assert sum(tuple(d.tolist()) == key for d in c["duplicated"]) >= 6
        assert sum(tuple(d.tolist()) == key for d in c["deduplicated"]) == 1
    # the held-out probes are in neither corpus
    seen = dup | {tuple(d.tolist()) for d in c["deduplicated"]}
    assert c["held_out"] and not any(tuple(d.tolist()) in seen for d in c["held_out"])


def test_steps_for_tokens_matches_what_train_counts():
    docs = make_corpus(0, 50, 4, 64).train
    per_step = D.step_tokens(docs, 64, 0, 30)
    assert len(per_step) == 30 and per_step.min() > 0
    assert D.steps_for_tokens(docs, 64, 0, int(per_step[:7].sum())) == 7
    assert D.steps_for_tokens(docs, 64, 0, int(per_step[:7].sum()) + 1) in (7, 8)


@pytest.mark.slow
def test_part_d_runs_end_to_end(lab, tmp_path, monkeypatch):
    small_d(monkeypatch)
    res = D.part_d(lab, tmp_path)
    runs = {r["corpus"]: r for r in res["runs"]}
    assert set(runs) == {"duplicated", "deduplicated"}
    assert runs["duplicated"]["steps"] == 3 == res["steps"]["duplicated"]
    # train counted exactly the tokens the sampler said these steps hold
    assert runs["duplicated"]["tokens_seen"] == res["tokens_target"]
    assert runs["deduplicated"]["steps"] == res["steps"]["deduplicated"]
    for r in runs.values():
        assert r["tokens_seen"] > 0
        assert r["gap"] == pytest.approx(r["val_loss"] - r["floor"])
        # the parameters read back from the checkpoint give train's own validation loss
        assert r["val_recomputed"] == pytest.approx(r["val_loss"], rel=1e-6)
        assert math.isfinite(r["repeated_loss"]) and math.isfinite(r["held_out_loss"])
    for name, e in res["exact"].items():
        assert 0 < e["entropy"] < 3 and 0 < e["nll"] < 3
    assert (tmp_path / "dedup_training.png").exists()


def test_language_loss_is_token_weighted():
    docs = make_corpus(0, 8, 4, 64).train[:3]
    nll = np.concatenate([score_document(d)[0] for d in docs])
    got = D.language_loss(docs)
    assert got["tokens"] == len(nll) == sum(len(d) - 1 for d in docs)
    assert got["nll"] == pytest.approx(nll.mean())


def test_main_writes_results(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "K_VALUES", (16,))
    monkeypatch.setattr(D, "SHA1_K", 16)
    monkeypatch.setattr(D, "SEEDS", 3)
    assert D.main(["--parts", "a", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res) == {"a", "timings_s"} and res["a"]["rows"][0]["seeds"] == 3


@pytest.mark.slow
def test_full_size_run(tmp_path):
    """The real sizes (about a minute): deduplication beats duplication, and memorisation
    shows on the repeated documents only."""
    lab = D.Lab(0)
    c = D.part_c(lab, tmp_path)
    assert c["same_pages_kept"]
    d = D.part_d(lab, tmp_path)
    runs = {r["corpus"]: r for r in d["runs"]}
    dup, ded = runs["duplicated"], runs["deduplicated"]
    assert dup["gap"] > ded["gap"]
    assert dup["repeated_minus_nll"] < ded["repeated_minus_nll"] - 0.05
