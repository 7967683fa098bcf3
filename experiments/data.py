"""Week-2 day-4 notes §1.2-1.3: cleaning pretraining data, measured on the garden web.

    python -m experiments.data [--out runs/data] [--parts abcd] [--json]

a. MinHash estimates a Jaccard index: two documents of distinct words whose 5-word
   shingle sets share exactly 80 of 140 shingles (J = 4/7, checked with shingles.jaccard),
   signed with k = 16 ... 1024 permutations, 20 seeds each (minhash.signatures, "fast"
   shingle hash): the mean estimate, the standard deviation measured over the seeds next
   to sqrt(J (1 - J) / k), their ratio; and k = 128 under the "sha1" shingle hash beside
   "fast", to show that the two modes give the same distribution (figure: minhash_std.png)
b. the LSH S-curve 1 - (1 - s^r)^b: the lecture's three points computed at b = 20, r = 5
   (lsh_params.candidate_probability), then measured: pairs of web pages of known exact Jaccard
   (each derived page with its source, spread over 0..1 by the near-duplicates, and random
   unrelated pairs for the low bins), signed with k = 100 for (20, 5) and k = 128 for the
   pipeline's (b, r) = lsh_params.optimal_params(0.7, 128); per Jaccard bin the pairs, the
   measured candidate rate (lsh_scurve.s_curve), the formula at the bin's mean Jaccard and averaged
   over its pairs, and how many standard errors the measurement lies from the formula
   (figure: s_curve.png)
c. the pipeline's funnel on make_web(10000): clean() with its defaults, each stage's pages
   in / removed / kept, seconds, and precision / recall against the corpus's ground truth
   (truth.score_report); then pairs: every LSH candidate pair among the pages that reach
   deduplication against the true pairs (web.duplicate_pairs) among them, before and after
   verification by exact Jaccard, and the candidates per page, at thresholds 0.5, 0.7 (the
   default) and 0.8, each with the (b, r) optimal_params picks (figure: funnel.png)
d. what duplicates cost in training: the tiny garden model trained at equal tokens on a
   corpus where 64 documents fill over a third of the rows, and on that corpus deduplicated
   by clean() (no filters, no decontamination, threshold 0.7) and topped up with fresh
   documents to the same number of documents. Same batch (16 documents); the deduplicated
   run takes the number of steps whose batches hold the duplicated run's tokens (its
   documents are longer on average). Shown: the final validation loss and its gap to the
   entropy floor, and memorisation, the loss of each trained model on the repeated
   documents and on fresh held-out ones, beside the exact loss and entropy of those
   documents under the garden language (figure: dedup_training.png)

Every number printed is computed by the project's code on these inputs (jaxscale.data,
jaxscale.training.config); only the sizes and seeds are chosen. For reference, the lecture notes give
0.047, 0.470 and 0.975 for part b's three points and sqrt(J (1 - J) / k) for part a.
"""
from __future__ import annotations

import contextlib
import logging
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments._runner import log, run_experiment
from jaxscale.data import dedup, lsh, lsh_params, lsh_scurve, minhash, truth
from jaxscale.data.clean import clean
from jaxscale.data.clean_config import CleanConfig
from jaxscale.data.clean_report import stage_note
from jaxscale.data.shingles import jaccard, shingle_set
from jaxscale.data.web import KINDS, make_web
from jaxscale.report import print_table, pyplot, save_figure
from jaxscale.model import config as model_config

# a. MinHash
SHARED, ONLY_A, ONLY_B = 80, 30, 30  # shingles in both documents, in A only, in B only
K_VALUES = (16, 32, 64, 128, 256, 512, 1024)
SEEDS = 20
SHA1_K = 128  # the k at which the two shingle hashes are compared

# b. the S-curve
LECTURE_S = (0.3, 0.5, 0.7)
LECTURE_BR = (20, 5)
S_CURVE_WEB = 4000  # pages
S_CURVE_NEAR_DUPLICATES = 0.25  # of the pages (default mix: 0.10): more pairs per bin
RANDOM_PAIRS = 3000  # unrelated pages, for the low bins
S_CURVE_K = {LECTURE_BR: 100}  # and the pipeline's (b, r) at k = 128
PIPELINE_K, PIPELINE_THRESHOLD = 128, 0.7
BINS = np.linspace(0.0, 1.0, 11)

# c. the funnel
FUNNEL_WEB = 10_000
PAIR_THRESHOLDS = (0.5, 0.7, 0.8)

# d. training on duplicates
D_DOCS = 2048  # documents in each training corpus
D_REPEATED, D_COPIES = 64, 12  # 64 documents, each 12 times: 768 of 2048 rows (37.5%)
D_POOL = 4096  # garden documents drawn, to build both corpora from
D_VAL = 256
D_STEPS, D_BATCH = 400, 16  # on the duplicated corpus: 6,400 documents, ~3 passes, so a
#                            repeated one is seen ~37 times; the deduplicated run takes as
#                            many steps as hold the same tokens
D_LR, D_WARMUP = 5e-3, 40
D_THRESHOLD = 0.7


class Lab:
    """The web corpora, each made once and shared by the parts."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._webs: dict = {}

    def web(self, n: int, **mix):
        key = (n, tuple(sorted(mix.items())))
        if key not in self._webs:
            t = time.perf_counter()
            self._webs[key] = make_web(n, self.seed, **mix)
            log(f"    make_web({n:,}{''.join(f', {k}={v}' for k, v in mix.items())}): "
                f"{time.perf_counter() - t:.1f} s")
        return self._webs[key]


# ------------------------------------------------------------------------------------
# a. MinHash estimates of a known Jaccard
# ------------------------------------------------------------------------------------

def known_pair(shared: int = SHARED, only_a: int = ONLY_A, only_b: int = ONLY_B):
    """Two documents of distinct words whose shingle sets share exactly `shared` shingles,
    with `only_a` and `only_b` of their own: A = common words + its own tail, B = its own
    head + the common words (n distinct words make n - 4 shingles)."""
    n = 5  # shingles.SHINGLE_WORDS
    common = [f"c{i}" for i in range(shared + n - 1)]
    a = " ".join(common + [f"a{i}" for i in range(only_a)])
    b = " ".join([f"b{i}" for i in range(only_b)] + common)
    return a, b


def estimates(a: str, b: str, k: int, seeds: int, shingle_hash: str) -> np.ndarray:
    """The MinHash estimate of J(a, b) under each of `seeds` permutation seeds."""
    return np.array([float(minhash.estimate_jaccard(*minhash.signatures(
        [a, b], k, seed, shingle_hash))) for seed in range(seeds)])


def estimate_row(est: np.ndarray, j: float, k: int, shingle_hash: str) -> dict:
    formula = math.sqrt(j * (1 - j) / k)
    std = float(est.std(ddof=1))
    mean = float(est.mean())
    return {"k": k, "shingle_hash": shingle_hash, "seeds": len(est), "mean": mean,
            "std": std, "formula_std": formula, "ratio": std / formula,
            # the mean of the seeds' estimates has standard error formula / sqrt(seeds)
            "mean_off_in_se": (mean - j) / (formula / math.sqrt(len(est))),
            "min": float(est.min()), "max": float(est.max()), "estimates": est.tolist()}


def part_a(lab: Lab, out: Path) -> dict:
    a, b = known_pair()
    sa, sb = shingle_set(a), shingle_set(b)
    j = jaccard(sa, sb)
    sets = {"A": len(sa), "B": len(sb), "both": len(sa & sb), "either": len(sa | sb)}
    rows = [estimate_row(estimates(a, b, k, SEEDS, "fast"), j, k, "fast") for k in K_VALUES]
    sha1 = estimate_row(estimates(a, b, SHA1_K, SEEDS, "sha1"), j, SHA1_K, "sha1")
    fast = next(r for r in rows if r["k"] == SHA1_K)
    # the two modes' means, as a two-sample difference in its standard error
    modes_se = math.hypot(fast["std"], sha1["std"]) / math.sqrt(SEEDS)
    modes_z = (sha1["mean"] - fast["mean"]) / modes_se
    print_table(f"a. MinHash estimates of J = {sets['both']}/{sets['either']} = {j:.4f} "
                f"(|A| = {sets['A']}, |B| = {sets['B']} shingles); {SEEDS} seeds per k; "
                "std over the seeds (ddof 1) beside sqrt(J(1-J)/k)",
                ["k", "shingle hash", "mean estimate", "mean - J (in SE of the mean)",
                 "measured std", "sqrt(J(1-J)/k)", "measured / formula", "min", "max"],
                [[r["k"], r["shingle_hash"], r["mean"], r["mean_off_in_se"], r["std"],
                  r["formula_std"], r["ratio"], r["min"], r["max"]] for r in rows + [sha1]])
    print(f"  k = {SHA1_K}: sha1 mean {sha1['mean']:.4f} vs fast {fast['mean']:.4f}, "
          f"{modes_z:+.2f} standard errors apart; std {sha1['std']:.4f} vs {fast['std']:.4f}")

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ks = np.array(K_VALUES, float)
    fine = np.geomspace(ks[0], ks[-1], 100)
    ax.plot(fine, np.sqrt(j * (1 - j) / fine), color="k", lw=1, label="sqrt(J(1-J)/k)")
    ax.plot(ks, [r["std"] for r in rows], "o", color="C0",
            label=f"measured over {SEEDS} seeds (fast)")
    ax.plot([SHA1_K], [sha1["std"]], "s", mfc="none", color="C3", ms=9,
            label=f"measured, sha1 (k = {SHA1_K})")
    ax.set(xscale="log", yscale="log", xlabel="permutations k",
           ylabel="std of the MinHash estimate",
           title=f"MinHash of J = {j:.4f}: spread of the estimate")
    ax.legend(fontsize=8)
    save_figure(fig, out / "minhash_std.png")
    return {"jaccard": j, "sets": sets, "rows": rows, "sha1": sha1,
            "sha1_vs_fast_mean_z": modes_z}


# ------------------------------------------------------------------------------------
# b. the S-curve, computed and measured
# ------------------------------------------------------------------------------------

def s_curve_pairs(web, n_random: int, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Pairs of pages with their exact Jaccard: each derived page with its source (the
    corpus records the Jaccard), and random unrelated pairs (computed here, exactly)."""
    derived = np.flatnonzero(web.source >= 0)
    made = np.stack([derived, web.source[derived]], axis=1)
    rng = np.random.default_rng([seed, 2])
    n = len(web)
    constructed = {tuple(p) for p in web.duplicate_pairs(0.0).tolist()}
    rand = []
    while len(rand) < n_random:
        i, j = (int(x) for x in rng.integers(0, n, 2))
        if i != j and (min(i, j), max(i, j)) not in constructed:
            rand.append((i, j))
    rand = np.asarray(rand, np.int64).reshape(-1, 2)
    pairs = np.concatenate([made, rand])
    pages = np.unique(pairs)
    sets = {int(i): shingle_set(web.texts[i]) for i in pages}
    exact = dedup.jaccards(pairs, [sets.get(i, frozenset()) for i in range(n)])
    recorded = web.jaccard[derived]
    levels = np.concatenate([recorded, exact[len(made):]])
    return pairs, levels, {"derived_pairs": len(made), "random_pairs": len(rand),
                           "recorded_vs_exact_max_diff":
                               float(np.max(np.abs(recorded - exact[:len(made)])))}


def bin_means(levels: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The mean Jaccard of each bin, binned as lsh_scurve.s_curve bins ([lo, hi), the last
    closed)."""
    which = np.clip(np.searchsorted(edges, levels, side="right") - 1, 0, len(edges) - 2)
    return np.array([levels[which == k].mean() if np.any(which == k) else np.nan
                     for k in range(len(edges) - 1)])


def sigmas(row) -> float:
    """(measured - formula averaged over the bin's pairs) / standard error; a bin whose
    pairs are all certain (p = 0 or 1) has no spread: 0 if it matches, inf if not."""
    diff = row.measured - row.predicted_mean
    if row.stderr > 0:
        return diff / row.stderr
    return 0.0 if abs(diff) < 1e-12 else math.inf


def part_b(lab: Lab, out: Path) -> dict:
    b, r = LECTURE_BR
    lecture = [{"s": s, "p": lsh_params.candidate_probability(s, b, r)} for s in LECTURE_S]
    print(f"b. the S-curve 1 - (1 - s^r)^b at b = {b}, r = {r} (k = {b * r}), computed by "
          "lsh_params.candidate_probability; its step sits near (1/b)^(1/r) = "
          f"{lsh_params.threshold_estimate(b, r):.3f}")
    print_table(f"b. the lecture's points, b = {b}, r = {r}",
                ["Jaccard s", "P(candidate)", "rounded"],
                [[x["s"], x["p"], f"{x['p']:.3f}"] for x in lecture])

    web = lab.web(S_CURVE_WEB, near_duplicate=S_CURVE_NEAR_DUPLICATES)
    pairs, levels, about = s_curve_pairs(web, RANDOM_PAIRS, lab.seed)
    pipeline = lsh_params.optimal_params(PIPELINE_THRESHOLD, PIPELINE_K)
    configs = [(LECTURE_BR, S_CURVE_K[LECTURE_BR], "the lecture's"),
               (pipeline, PIPELINE_K, f"optimal_params({PIPELINE_THRESHOLD}, {PIPELINE_K})")]
    pages = np.unique(pairs)
    local = np.searchsorted(pages, pairs)  # pairs as rows of the pages' signatures
    texts = [web.texts[i] for i in pages]
    means = bin_means(levels, BINS)
    curves = []
    for (bands, rows), k, name in configs:
        t = time.perf_counter()
        sig = minhash.signatures(texts, k, 1, "fast")
        log(f"    signatures of {len(texts):,} pages, k = {k}: {time.perf_counter() - t:.1f} s")
        got = lsh_scurve.s_curve(sig, local, levels, bands, rows, BINS)
        table = []
        for row, mean in zip(got, means):
            table.append({"lo": row.lo, "hi": row.hi, "pairs": row.pairs, "mean_jaccard": mean,
                          "measured": row.measured, "formula_at_mean": row.predicted_at_mean,
                          "formula_mean": row.predicted_mean, "stderr": row.stderr,
                          "sigmas": sigmas(row) if row.pairs else math.nan})
        curves.append({"bands": bands, "rows": rows, "k": k, "name": name, "bins": table,
                       "max_abs_sigmas": float(np.nanmax([abs(x["sigmas"]) for x in table]))})
        print_table(f"b. measured S-curve, b = {bands}, r = {rows} (k = {k}, {name}): "
                    f"{about['derived_pairs']:,} derived pages with their sources and "
                    f"{about['random_pairs']:,} random pairs of make_web({S_CURVE_WEB:,}); "
                    "the SE is sqrt(sum p(1-p))/pairs over the bin's pairs",
                    ["Jaccard bin", "pairs", "mean Jaccard", "measured rate",
                     "formula at bin mean", "formula over the pairs", "SE",
                     "(measured - formula) / SE"],
                    [[f"{x['lo']:.1f}-{x['hi']:.1f}", x["pairs"], x["mean_jaccard"],
                      x["measured"], x["formula_at_mean"], x["formula_mean"], x["stderr"],
                      x["sigmas"]] for x in table])
    print(f"  the recorded Jaccard of each derived page (web.jaccard) and dedup.jaccards of the "
          f"same pair differ by at most {about['recorded_vs_exact_max_diff']:.2g}")

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    s = np.linspace(0, 1, 201)
    for i, c in enumerate(curves):
        color = f"C{i}"
        ax.plot(s, lsh_params.candidate_probability(s, c["bands"], c["rows"]), color=color, lw=1,
                label=f"1-(1-s^{c['rows']})^{c['bands']} (k = {c['k']}, {c['name']})")
        x = [row["mean_jaccard"] for row in c["bins"] if row["pairs"]]
        y = [row["measured"] for row in c["bins"] if row["pairs"]]
        err = [2 * row["stderr"] for row in c["bins"] if row["pairs"]]
        ax.errorbar(x, y, yerr=err, fmt="o", color=color, ms=4, capsize=3,
                    label="measured per bin (+- 2 SE)")
    for x in lecture:
        ax.plot(x["s"], x["p"], "x", color="k", ms=7)
    ax.axvline(PIPELINE_THRESHOLD, color="0.5", ls=":", lw=0.8)
    ax.set(xlabel="exact Jaccard of the pair's shingle sets",
           ylabel="fraction that become LSH candidates",
           title="the S-curve: formula and measured on garden web pages")
    ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, out / "s_curve.png")
    return {"lecture": lecture, "pairs": about, "curves": curves}


# ------------------------------------------------------------------------------------
# c. the pipeline's funnel and its pairs
# ------------------------------------------------------------------------------------

def reached_dedup(report) -> np.ndarray:
    """The pages no filter and no decontamination removed (in input order)."""
    names = [s.name for s in report.stages]
    early = [names.index("filters"), names.index("decontamination")]
    return np.flatnonzero(~np.isin(report.removed_by, early))


def pair_rows(web, pages: np.ndarray, thresholds, num_perm: int, seed: int,
              shingle_hash: str) -> tuple[list[dict], dict]:
    """Pair-level precision and recall of LSH candidates among `pages`, before and after
    verification, per threshold (each with optimal_params' bands and rows)."""
    texts = [web.texts[i] for i in pages]
    t = time.perf_counter()
    sig = minhash.signatures(texts, num_perm, seed, shingle_hash)
    sig_s = time.perf_counter() - t
    inside = np.zeros(len(web), bool)
    inside[pages] = True
    sets: dict[int, frozenset] = {}
    rows, verified_at = [], {}
    for threshold in thresholds:
        bands, r = lsh_params.optimal_params(threshold, num_perm)
        cand = lsh.candidate_pairs(lsh.band_keys(sig, bands, r))  # rows of `pages`
        for i in np.unique(cand):
            if int(i) not in sets:
                sets[int(i)] = shingle_set(texts[i])
        ok = dedup.verify(cand, [sets.get(i, frozenset()) for i in range(len(pages))],
                        threshold) if len(cand) else np.zeros(0, bool)
        true = web.duplicate_pairs(threshold)
        true = true[inside[true[:, 0]] & inside[true[:, 1]]]
        before = dedup.pair_scores(pages[cand], true)
        after = dedup.pair_scores(pages[cand[ok]], true)
        verified_at[threshold] = cand[ok]
        rows.append({"threshold": threshold, "bands": bands, "rows": r,
                     "pages": len(pages), "true_pairs": len(true), "candidates": len(cand),
                     "candidates_per_page": len(cand) / len(pages), "verified": int(ok.sum()),
                     "before": before, "after": after,
                     # pairs that really are this similar but not by construction (pages
                     # sharing pool documents by chance): the truth does not list them
                     "verified_not_in_truth": after["predicted"] - after["true_positives"]})
    return rows, {"signature_s": sig_s, "verified": verified_at}


def kind_counts(web, alive: np.ndarray) -> dict[str, int]:
    return {k: int(np.sum(web.kind[alive] == i)) for i, k in enumerate(KINDS)}


def part_c(lab: Lab, out: Path) -> dict:
    web = lab.web(FUNNEL_WEB)
    cfg = CleanConfig()
    report = clean(list(web.texts), cfg, validation=web.validation)
    scores = truth.score_report(report, web)["stages"]
    stage_rows = []
    for s in report.stages:
        sc = scores.get(s.name)
        stage_rows.append({"stage": s.name, "in": s.docs_in, "removed": s.removed,
                           "kept": s.kept, "seconds": s.seconds,
                           "precision": sc["precision"] if sc else None,
                           "recall": sc["recall"] if sc else None,
                           "should_remove": sc["should"] if sc else None,
                           "detail": s.detail})

    print_table(f"c. clean() with its defaults on make_web({FUNNEL_WEB:,}): "
                f"{len(report.kept):,} of {report.docs:,} pages kept in {report.seconds:.2f} s "
                f"({report.docs_per_s:,.0f} pages/s); precision and recall against the "
                "corpus's labels (truth.score_report)",
                ["stage", "in", "removed", "kept", "seconds", "should remove", "precision",
                 "recall", "detail"],
                [[s["stage"], s["in"], s["removed"], s["kept"], s["seconds"],
                  "" if s["should_remove"] is None else s["should_remove"],
                  "" if s["precision"] is None else s["precision"],
                  "" if s["recall"] is None else s["recall"],
                  stage_note(s["stage"], s["detail"])]
                 for s in stage_rows])

    pages = reached_dedup(report)
    t = cfg.verify_threshold()  # the pipeline's own threshold is always among them
    rows, extra = pair_rows(web, pages, sorted({*PAIR_THRESHOLDS, t}), cfg.num_perm, cfg.seed,
                            cfg.shingle_hash)
    print_table(f"c. pairs among the {len(pages):,} pages that reach deduplication (k = "
                f"{cfg.num_perm}): every LSH candidate pair, and those whose exact Jaccard "
                "reaches the threshold, against the corpus's true pairs (web.duplicate_pairs) "
                "among the same pages",
                ["threshold", "b x r", "true pairs", "candidates", "per page",
                 "precision before", "recall before", "F1 before", "verified",
                 "precision after", "recall after", "F1 after", "verified, not in truth"],
                [[x["threshold"], f"{x['bands']} x {x['rows']}", x["true_pairs"],
                  x["candidates"], x["candidates_per_page"], x["before"]["precision"],
                  x["before"]["recall"], x["before"]["f1"], x["verified"],
                  x["after"]["precision"], x["after"]["recall"], x["after"]["f1"],
                  x["verified_not_in_truth"]] for x in rows])
    # the verified pairs at the pipeline's threshold, clustered, remove what clean removed
    labels = dedup.clusters(len(pages), extra["verified"][t])
    removed_here = int(len(pages) - dedup.keep_mask(labels).sum())
    removed_clean = next(s.removed for s in report.stages if s.name == "clusters")
    same = bool(np.array_equal(pages[dedup.keep_mask(labels)], report.kept))
    print(f"  at J >= {t:g}: clustering all verified candidate pairs removes {removed_here:,} "
          f"pages, clean()'s clusters stage removed {removed_clean:,}; the same pages kept: "
          f"{'yes' if same else 'NO'}")

    funnel = [("input", np.arange(len(web)))]
    alive = np.arange(len(web))
    for i, s in enumerate(report.stages):
        if s.removed or s.name in ("filters", "decontamination", "clusters"):
            alive = alive[report.removed_by[alive] != i]
            funnel.append((f"after {s.name}", alive))
    counts = [(name, kind_counts(web, idx)) for name, idx in funnel]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = np.zeros(len(counts))
    for i, kind in enumerate(KINDS):
        h = np.array([c[kind] for _, c in counts], float)
        ax.bar(range(len(counts)), h, bottom=bottom, color=f"C{i}", label=kind)
        bottom += h
    for x, total in enumerate(bottom):
        ax.annotate(f"{int(total):,}", (x, total), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8)
    ax.set_xticks(range(len(counts)), [name for name, _ in counts])
    ax.set(ylabel="pages", title=f"clean() on make_web({FUNNEL_WEB:,}): the pages each "
           "stage lets through, by true kind")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_figure(fig, out / "funnel.png")
    return {"report": report.as_json(), "scores": scores, "stages": stage_rows,
            "pairs": rows, "dedup_pages": len(pages), "pair_signature_s": extra["signature_s"],
            "removed_by_verified_pairs": removed_here, "removed_by_clean": removed_clean,
            "same_pages_kept": same, "funnel": counts}


# ------------------------------------------------------------------------------------
# d. training on duplicates, and on the same corpus deduplicated
# ------------------------------------------------------------------------------------

def doc_text(doc) -> str:
    from jaxscale.garden.words import VOCAB
    return " ".join(VOCAB[int(t)] for t in doc)


def first_distinct(docs, n: int, start: int = 0) -> tuple[list, int]:
    """The first n pairwise different documents from docs[start:], and where it stopped."""
    seen, out, i = set(), [], start
    while len(out) < n:
        key = tuple(docs[i].tolist())
        if key not in seen:
            seen.add(key)
            out.append(docs[i])
        i += 1
    return out, i


def dedup_corpora(seed: int) -> dict:
    """The duplicated corpus, its deduplicated version (same size), and the documents to
    probe memorisation with. Rows are garden documents as token ids."""
    from jaxscale import garden

    seq_len = model_config.preset("tiny").seq_len
    base = garden.make_corpus(seed, D_POOL, D_VAL, seq_len)
    repeated, at = first_distinct(base.train, D_REPEATED)
    n_fill = D_DOCS - D_REPEATED * D_COPIES
    fill = list(base.train[at:at + n_fill])
    pool = list(base.train[at + n_fill:])  # fresh documents, for the top-up
    rng = np.random.default_rng([seed, 3])
    rows = repeated * D_COPIES + fill
    is_copy = np.array([True] * (D_REPEATED * D_COPIES) + [False] * n_fill)
    order = rng.permutation(len(rows))
    rows, is_copy = [rows[i] for i in order], is_copy[order]
    cfg = CleanConfig(filters=(), decontaminate=False, threshold=D_THRESHOLD,
                      shingle_hash="fast")
    t = time.perf_counter()
    report = clean([doc_text(d) for d in rows], cfg)
    kept = [rows[i] for i in report.kept]
    # top up with fresh documents that clean() keeps beside the kept ones: a cluster's
    # smallest index is kept, so a fresh document kept here duplicates no kept one
    topped = clean([doc_text(d) for d in kept + pool], cfg)
    fresh = [pool[i - len(kept)] for i in topped.kept if i >= len(kept)]
    clean_s = time.perf_counter() - t
    if len(kept) + len(fresh) < D_DOCS:
        raise ValueError(f"only {len(kept) + len(fresh)} distinct documents to fill "
                         f"{D_DOCS} rows: raise D_POOL")
    deduped = kept + fresh[:D_DOCS - len(kept)]
    removed = np.setdiff1d(np.arange(len(rows)), report.kept)
    in_train = {tuple(d.tolist()) for d in rows + deduped}
    held_out = [d for d in base.val if tuple(d.tolist()) not in in_train]
    return {"base": base, "duplicated": rows, "deduplicated": deduped,
            "repeated": repeated, "held_out": held_out, "report": report,
            "clean_s": clean_s, "removed": len(removed),
            "removed_copies": int(is_copy[removed].sum()),
            "copies": int(is_copy.sum()), "kept": len(kept), "topped_up": len(deduped) - len(kept),
            "mean_tokens": {"chance duplicates removed": _mean_tokens(
                                [rows[i] for i in removed if not is_copy[i]]),
                            "fresh documents added": _mean_tokens(deduped[len(kept):]),
                            "all rows drawn": _mean_tokens(list(base.train))},
            "distinct": {name: len({tuple(d.tolist()) for d in docs})
                         for name, docs in (("duplicated", rows), ("deduplicated", deduped))},
            # the documents' target tokens (length - 1 each): what one pass trains on
            "tokens": {name: int(sum(len(d) - 1 for d in docs))
                       for name, docs in (("duplicated", rows), ("deduplicated", deduped))}}


def _mean_tokens(docs) -> float:
    return float(np.mean([len(d) - 1 for d in docs])) if len(docs) else math.nan


def language_loss(docs) -> dict:
    """The garden language's own per-token loss on these documents (what a perfect model
    scores) and its per-token entropy (the floor in expectation), token-weighted."""
    from jaxscale.garden.language import score_document
    nll, ent = zip(*(score_document(d) for d in docs))
    return {"nll": float(np.concatenate(nll).mean()),
            "entropy": float(np.concatenate(ent).mean()),
            "tokens": int(sum(len(x) for x in nll))}


def step_tokens(rows, seq_len: int, seed: int, steps: int) -> np.ndarray:
    """The target tokens of each of the first `steps` batches train draws from `rows`
    (the sampler is a pure function of the seed: nothing is trained to know them)."""
    from jaxscale.data.sampler import StepBatches
    batches = StepBatches(rows, D_BATCH, seq_len, seed)
    return np.array([batches.n_tokens(s) for s in range(steps)])


def steps_for_tokens(rows, seq_len: int, seed: int, tokens: int) -> int:
    """The number of steps whose batches from `rows` hold the nearest to `tokens` tokens."""
    cum = np.cumsum(step_tokens(rows, seq_len, seed, 3 * D_STEPS))
    return int(np.argmin(np.abs(cum - tokens))) + 1


def train_and_probe(rows, corpora: dict, seed: int, probes: dict, steps: int) -> dict:
    """Train the tiny model on `rows`; restore its final parameters from the checkpoint
    train writes at the last step (TrainResult holds none) and evaluate them on each
    probe set of documents."""
    from jaxscale import garden
    from jaxscale.training.checkpoint.manager import CheckpointOptions
    from jaxscale.training.checkpoint.tensors import read_canonical, unflat_items
    from jaxscale.training.config import TrainConfig
    from jaxscale.training.reference import evaluate, init_run, make_eval_step
    from jaxscale.training.loop import train

    base = corpora["base"]
    cfg = TrainConfig(model="tiny", steps=steps, batch_size=D_BATCH, lr=D_LR,
                      warmup=D_WARMUP, seed=seed, eval_every=steps)
    corpus = garden.Corpus(train=tuple(rows), val=base.val, seq_len=base.seq_len, seed=seed)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        r = train(cfg, progress=False, corpus=corpus,
                  checkpoint=CheckpointOptions(str(Path(tmp) / "ckpt"), every=steps))
        with _quiet_orbax():
            saved = read_canonical(Path(tmp) / "ckpt", r.steps_run)
    wall = time.perf_counter() - t
    graphdef, like, _ = init_run(cfg)
    params = unflat_items(saved, {"params": like})["params"]
    step = make_eval_step(graphdef)

    def loss_on(docs):
        return evaluate(step, params, [garden.make_batch(docs[i:i + 4 * D_BATCH],
                                                         base.seq_len)
                                       for i in range(0, len(docs), 4 * D_BATCH)])
    probed = {name: loss_on(docs) for name, docs in probes.items()}
    return {"result": r, "wall_s": wall, "probes": probed,
            # the restored parameters give the validation loss train reported
            "val_recomputed": loss_on(list(base.val))}


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax warns on reading a checkpoint that it wrote without its metadata file."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def part_d(lab: Lab, out: Path) -> dict:
    t = time.perf_counter()
    c = dedup_corpora(lab.seed)
    log(f"    corpora and clean(): {time.perf_counter() - t:.1f} s")
    probes = {"repeated": c["repeated"], "held_out": c["held_out"]}
    exact = {name: language_loss(docs) for name, docs in probes.items()}
    # equal tokens: the duplicated corpus trains D_STEPS steps, the deduplicated one as many
    # as hold the same tokens (its documents are longer on average: the chance duplicates
    # clean() removes are short ones)
    seq_len = c["base"].seq_len
    tokens = int(step_tokens(c["duplicated"], seq_len, lab.seed, D_STEPS).sum())
    steps = {"duplicated": D_STEPS,
             "deduplicated": steps_for_tokens(c["deduplicated"], seq_len, lab.seed, tokens)}
    runs = {}
    for name in ("duplicated", "deduplicated"):
        runs[name] = train_and_probe(c[name], c, lab.seed, probes, steps[name])
        log(f"    trained on the {name} corpus: {runs[name]['wall_s']:.1f} s")
    print(f"d. the duplicated corpus: {D_REPEATED} documents x {D_COPIES} copies among "
          f"{D_DOCS - D_REPEATED * D_COPIES:,} others; clean() (no filters, no "
          f"decontamination, J >= {D_THRESHOLD:g}) removed {c['removed']:,} rows "
          f"({c['removed_copies']:,} of the {c['copies'] - D_REPEATED:,} extra copies, "
          f"{c['removed'] - c['removed_copies']:,} chance duplicates of the garden language); "
          f"{c['topped_up']:,} fresh documents that clean() keeps beside them refill it "
          f"({c['clean_s']:.1f} s)")
    print_table("d. the two training corpora",
                ["corpus", "rows", "distinct documents", "tokens (targets)"],
                [[name, len(c[name]), c["distinct"][name], f"{c['tokens'][name]:,}"]
                 for name in ("duplicated", "deduplicated")])
    rows = []
    for name, run in runs.items():
        r = run["result"]
        rows.append({"corpus": name, "steps": r.steps_run, "tokens_seen": r.tokens_seen,
                     "val_loss": r.val_loss, "floor": r.entropy_floor, "gap": r.gap,
                     "val_recomputed": run["val_recomputed"], "wall_s": run["wall_s"],
                     **{f"{p}_loss": v for p, v in run["probes"].items()},
                     **{f"{p}_minus_nll": run["probes"][p] - exact[p]["nll"] for p in probes}})
    print_table(f"d. the tiny model, {D_BATCH} documents a step, at equal tokens (AdamW lr "
                f"{D_LR:g}, cosine): validation on {len(c['base'].val)} held-out "
                "documents; probes: the repeated documents, and the validation documents "
                "found in neither corpus; 'loss - exact' is the model's loss minus the garden "
                "language's own loss on the same documents (below 0: memorised)",
                ["trained on", "steps", "tokens seen", "val loss", "entropy floor",
                 "gap to floor",
                 f"loss on the {D_REPEATED} repeated", "  - exact",
                 f"loss on {len(c['held_out'])} held out", "  - exact", "wall s"],
                [[x["corpus"], x["steps"], f"{x['tokens_seen']:,}", x["val_loss"], x["floor"],
                  x["gap"],
                  x["repeated_loss"], x["repeated_minus_nll"], x["held_out_loss"],
                  x["held_out_minus_nll"], x["wall_s"]] for x in rows])
    print_table("d. the garden language's exact per-token figures of the probe documents "
                "(jaxscale.garden.language.score_document)",
                ["probe set", "documents", "tokens", "exact loss (true NLL)",
                 "entropy (expected loss)"],
                [[name, len(probes[name]), exact[name]["tokens"], exact[name]["nll"],
                  exact[name]["entropy"]] for name in probes])
    dup, ded = (next(x for x in rows if x["corpus"] == n) for n in ("duplicated",
                                                                   "deduplicated"))
    print(f"  the duplicated corpus's model: gap {dup['gap']:.4f} vs {ded['gap']:.4f} "
          f"({dup['gap'] - ded['gap']:+.4f}); on the repeated documents "
          f"{dup['repeated_loss']:.4f} vs {ded['repeated_loss']:.4f}, on held-out ones "
          f"{dup['held_out_loss']:.4f} vs {ded['held_out_loss']:.4f}")
    print(f"  equal tokens: the deduplicated run's {ded['steps']} steps hold the tokens of "
          f"the duplicated run's {dup['steps']} (tokens seen differ by "
          f"{ded['tokens_seen'] / dup['tokens_seen'] - 1:+.2%}); its documents are longer "
          "(mean target tokens of a document: " + ", ".join(
              f"{k} {v:.1f}" for k, v in c["mean_tokens"].items() if v == v) + ")")
    print("  (the parameters are read back from the checkpoint train writes at its last step; "
          "evaluated on the validation set they give train's val loss: "
          + ", ".join(f"{x['val_recomputed']:.6f} vs {x['val_loss']:.6f}" for x in rows) + ")")

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, run) in enumerate(runs.items()):
        r = run["result"]
        seen = np.cumsum(step_tokens(c[name], seq_len, lab.seed, r.steps_run))
        w = min(10, len(r.loss_curve))
        curve = np.convolve(r.loss_curve, np.ones(w) / w, mode="valid")
        ax.plot(seen[w - 1:], curve, color=f"C{i}", lw=0.9,
                label=f"{name}: training loss ({w}-step mean)")
        ax.plot([seen[step - 1] for step, _ in r.val_curve], [v for _, v in r.val_curve], "D",
                color=f"C{i}", ms=6, mec="white", label=f"{name}: validation {r.val_loss:.4f}")
    ax.axhline(dup["floor"], color="k", ls="--", lw=0.8, label="entropy floor")
    ax.set(xlabel="tokens seen", ylabel="loss (nats per token)", ylim=(0, None),
           title=f"tiny model, {D_BATCH} documents a step, equal tokens: duplicated vs "
           "deduplicated")
    ax.legend(fontsize=8)
    save_figure(fig, out / "dedup_training.png")
    return {"corpora": {k: c[k] for k in ("removed", "removed_copies", "copies", "kept",
                                          "topped_up", "distinct", "tokens", "mean_tokens",
                                          "clean_s")},
            "exact": exact, "runs": rows, "steps": steps, "tokens_target": tokens,
            "curves": {name: {"loss": run["result"].loss_curve,
                              "val": run["result"].val_curve} for name, run in runs.items()}}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
TITLES = {"a": "MinHash estimates of a known Jaccard",
          "b": "the LSH S-curve, computed and measured",
          "c": "the cleaning pipeline's funnel and its pairs",
          "d": "training on duplicates vs deduplicated"}


def main(argv=None) -> int:
    return run_experiment("data", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    raise SystemExit(main())
