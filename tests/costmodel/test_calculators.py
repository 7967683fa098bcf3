"""`jaxscale memory`, `comm`, `failures` and `plan`: --json figures against the lectures'
numbers, human tables in good grammar, --help, huge inputs, and bad input (negative, nan,
inf, too large) as one line with exit code 2."""
import re

import pytest

from jaxscale.model.config import param_count, preset
from jaxscale.report import plural

GIB = 2**30




# ------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------

def test_memory_zero_paper_table(cli):
    r = cli("memory", "--params", "7.5e9", "--devices", "64", "--json")
    got = [x["total"] / 1e9 for x in r["model_states"]["mixed"]]
    assert got == pytest.approx([16 * 7.5, (4 + 12 / 64) * 7.5, (2 + 14 / 64) * 7.5, 16 * 7.5 / 64])
    assert [round(x, 1) for x in got[:3]] == [120.0, 31.4, 16.6] and round(got[3], 2) == 1.88
    assert [x["name"] for x in r["model_states"]["mixed"]] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert r["model_states"]["fp32"][1]["total"] == pytest.approx((8 + 8 / 64) * 7.5e9)
    assert r["activations"] is None and r["params_source"] == "given"


def test_memory_day4_tables_and_exercise_2(cli):
    r = cli("memory", "--params", "7B", "--devices", "8", "--json")
    assert [round(x["total"] / GIB, 1) for x in r["model_states"]["mixed"]] == [104.3, 35.9, 24.4, 13.0]
    r = cli("memory", "--params", "70e9", "--devices", "64", "--json")
    assert r["model_states"]["mixed"][0]["total"] / 1e9 == pytest.approx(16 * 70)  # 1120 GB
    assert r["model_states"]["mixed"][3]["total"] / 1e9 == pytest.approx(1120 / 64)  # 17.5 GB


def test_memory_lecture_13_activations(cli):
    """32 layers, h = 4096, 32 heads, 8 x 2048 tokens: ~7.7 GB a layer, ~245 GB, ~12 GB."""
    r = cli("memory", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "32",
            "--seq", "2048", "--batch", "8", "--json")
    a = r["activations"]
    assert a["per_layer"] == 2048 * 8 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert round(a["per_layer"] / 1e9, 1) == 7.7
    assert round(a["total"]["stored"] / 1e9) == 245
    assert round(a["total"]["recompute"] / 1e9) == 12
    assert a["used"] == "stored" and a["used_bytes"] == a["total"]["stored"]
    assert r["per_device"][0]["total"] == pytest.approx(16 * 7e9 + a["total"]["stored"])


def test_memory_day4_group3_with_flags_and_qlora(cli):
    r = cli("memory", "--params", "6.74e9", "--layers", "32", "--hidden", "4096", "--heads", "32",
            "--seq", "4096", "--flash-attention", "--recompute", "--qlora", "--lora-rank", "16",
            "--json")
    a = r["activations"]
    assert round(a["total"]["stored"] / GIB) == 97 and round(a["total"]["stored_flash"] / GIB) == 17
    assert a["used"] == "recompute_flash" and round(a["used_bytes"] / GIB, 1) == 1.5
    f = r["finetune"]
    n = 32 * (4 * 16 * 8192 + 2 * 16 * (4096 + 4 * 4096))
    assert f["adapter_params"] == n and f["rank"] == 16
    assert f["rows"]["LoRA"]["total"] == pytest.approx(2 * 6.74e9 + 16 * n)
    assert f["rows"]["QLoRA"]["weights"] == pytest.approx(6.74e9 * (4 + 8 / 64 + 32 / 16384) / 8)
    assert f["rows"]["full fine-tune"]["total"] == pytest.approx(16 * 6.74e9)
    q = f["rows"]["QLoRA"]
    assert q["with_activations"] == pytest.approx(q["total"] + a["used_bytes"])


def test_memory_model_preset(cli):
    r = cli("memory", "--model", "7b", "--devices", "8", "--json")
    cfg = preset("7b")
    assert r["params"] == param_count(cfg) and r["params_source"] == "preset 7b's count"
    assert r["shape"]["layers"] == cfg.n_layers and r["shape"]["seq"] == cfg.seq_len
    assert r["activations"]["logits_fp32"] == 4 * cfg.seq_len * 1 * cfg.vocab_size
    # a shape without --params: parameters estimated as L(4h^2 + 2h ffn)
    r = cli("memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--json")
    assert r["params"] == 2 * (4 * 64 * 64 + 2 * 64 * 256)


def test_memory_human_tables(cli):
    out = cli("memory", "--params", "7.5e9", "--devices", "64")
    for text in ["ZeRO-3", "120.00 GB (111.76 GiB)", "31.41 GB", "16.64 GB", "1.88 GB", "fp32"]:
        assert text in out, out
    out = cli("memory", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "32",
              "--seq", "2048", "--batch", "8", "--lora-rank", "8")
    assert "244.81 GB" in out and "full recomputation" in out and "LoRA" in out


# ------------------------------------------------------------------------------------
# comm
# ------------------------------------------------------------------------------------

def test_comm_exercise_4(cli):
    """1B parameters, bf16, 8 devices, 50 GB/s: ring 3.5 GB (0.07 s) vs server 28 GB (0.56 s)."""
    r = cli("comm", "--params", "1e9", "--devices", "8", "--link", "50", "--json")
    d = r["dp"]
    assert d["ring_bytes_per_device"] == pytest.approx(2 * 7 / 8 * 2e9)
    assert d["ring_seconds"] == pytest.approx(0.07)
    assert d["server_total"] == pytest.approx(2 * 7 * 2e9)
    assert d["server_seconds"] == pytest.approx(0.56)
    assert r["link"] == "50 GB/s" and {x["link"] for x in r["per_link"]} == {
        "nvlink", "infiniband", "ethernet", "50 GB/s"}


def test_comm_7b_over_ethernet_and_lecture_strategies(cli):
    r = cli("comm", "--params", "7e9", "--devices", "8", "--link", "ethernet", "--layers", "32",
            "--hidden", "4096", "--seq", "2048", "--batch", "8", "--json")
    assert 19 < r["dp"]["ring_seconds"] < 21
    rows = {x["strategy"]: x for x in r["strategies"]["rows"]}
    assert rows["TP"]["one_bytes"] == 8 * 2048 * 4096 * 2 and round(rows["TP"]["one_bytes"] / 1e6) == 134
    assert rows["TP"]["count_per_step"] == 4 * 32
    assert round(rows["TP"]["payload_per_step"] / 1e9, 1) == 17.2
    assert round(rows["PP"]["one_bytes"] / 1e6) == 268
    assert rows["DP"]["payload_per_step"] == 7e9 * 2
    assert rows["TP"]["seconds"]["nvlink"] == pytest.approx(rows["TP"]["sent_per_device"] / 300e9)
    out = cli("comm", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--seq", "2048",
              "--batch", "8", "--tp", "4", "--pp", "2")
    assert "134.2 MB" in out and "17.18 GB" in out and "268.4 MB" in out


# ------------------------------------------------------------------------------------
# failures
# ------------------------------------------------------------------------------------

def test_failures_lecture_figures(cli):
    r = cli("failures", "--devices", "1024", "--mtbf-hours", "50000", "--save-minutes", "10", "--json")
    assert round(r["cluster_mtbf_hours"], 1) == round(50000 / 1024, 1) == 48.8
    assert round(r["young"]["interval"]) == 242
    assert round(100 * r["young"]["waste_first_order"], 1) == 8.3
    assert round(r["async"]["interval"]) == 77 and round(100 * r["async"]["waste_write_ignored"], 1) == 2.6
    r = cli("failures", "--devices", "16384", "--restart-minutes", "20", "--json")
    m = 50000 / 16384 * 60
    assert r["young"]["waste_first_order"] == pytest.approx((20 / m) ** 0.5 + 20 / m)
    out = cli("failures")
    assert "48.83 h" in out and "242.1 min" in out and "8.26%" in out and "2.61%" in out


# ------------------------------------------------------------------------------------
# help and bad input
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, words", [
    ("memory", ["--params", "--devices", "--flash-attention", "--recompute", "--lora-rank",
                "--qlora", "--model", "Korthikanti", "ZeRO", "GiB"]),
    ("comm", ["--link", "--grad-bytes", "--tp", "--pp", "parameter server", "2(K-1)/K"]),
    ("failures", ["--mtbf-hours", "--save-minutes", "--restart-minutes", "Young", "Daly",
                  "asynchronous"]),
    ("plan", ["--device-memory", "--node-size", "--max-bubble", "ZeRO", "rank by"]),
])
def test_help_explains(cli, capsys, command, words):
    with pytest.raises(SystemExit) as e:
        cli(command, "--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    for w in words:
        assert w in out, w


@pytest.mark.parametrize("argv, words", [
    (["memory", "--params", "-5"], ["--params", "'-5'", "> 0"]),
    (["memory", "--params", "0"], ["--params", "> 0"]),
    (["memory", "--params", "seven"], ["--params", "'seven'", "7e9"]),
    (["memory", "--params", "7e9", "--devices", "0"], ["--devices", "got 0"]),
    (["memory"], ["--params", "--model"]),
    (["memory", "--params", "7e9", "--layers", "32"], ["--hidden, --heads"]),
    (["memory", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "3"],
     ["--hidden 4096", "--heads 3"]),
    (["memory", "--params", "7e9", "--lora-rank", "8"], ["LoRA needs the model shape"]),
    (["memory", "--params", "7e9", "--seq", "4096"], ["--seq", "--layers --hidden --heads"]),
    (["comm", "--params", "7e9", "--vocab", "32000"], ["--vocab", "--model PRESET"]),
    (["memory", "--model", "7b", "--lora-rank", "5000"], ["--lora-rank 5000", "1..4096"]),
    (["memory", "--model", "huge"], ["'huge'", "tiny", "7b"]),
    (["comm", "--params", "7e9", "--link", "wifi"], ["'wifi'", "nvlink, infiniband, ethernet"]),
    (["comm", "--params", "7e9", "--link", "0"], ["--link", "> 0 GB/s"]),
    (["comm"], ["--params"]),
    (["comm", "--layers", "32", "--hidden", "4096", "--heads", "32", "--tp", "3"],
     ["--tp 3", "heads 32", "1, 2, 4, 8, 16, 32"]),
    (["comm", "--layers", "32", "--hidden", "4096", "--pp", "3"], ["--pp 3", "32 layers"]),
    (["comm", "--model", "tiny"], ["--tp 8 (the default: --devices 8)", "heads 4",
                                   "choose --tp from 1, 2, 4"]),
    (["comm", "--params", "7e9", "--act-bytes", "4"], ["--act-bytes needs the model's shape"]),
    (["comm", "--params", "7e9", "--grad-bytes", "0"], ["--grad-bytes", "got 0"]),
    (["failures", "--devices", "0"], ["--devices", "got 0"]),
    (["failures", "--save-minutes", "-1"], ["--save-minutes", "-1"]),
    (["failures", "--mtbf-hours", "0"], ["--mtbf-hours", "> 0"]),
    (["failures", "--restart-minutes", "-2"], ["--restart-minutes", ">= 0"]),
    (["plan", "--params", "70e9", "--devices", "64", "--device-memory", "80XB"],
     ["--device-memory", "'80XB'", "80GB"]),
    (["plan", "--params", "70e9", "--devices", "12"], ["--devices 12", "nodes of 8"]),
    (["plan", "--devices", "64"], ["--params"]),
    (["plan", "--params", "7e9", "--devices", "8", "--layers", "32", "--hidden", "4096",
      "--heads", "30"], ["--hidden 4096", "--heads 30"]),
    (["plan", "--params", "7e9", "--devices", "8", "--usable", "1.5"], ["--usable 1.5", "(0, 1]"]),
    (["plan", "--params", "7e9", "--devices", "8", "--max-bubble", "1"], ["--max-bubble 1"]),
    (["plan", "--params", "7e9", "--devices", "8", "--intra-link", "pcie"], ["'pcie'", "nvlink"]),
    # negative numbers that argparse alone takes for options, nan, inf, too large
    (["memory", "--params", "-7e9"], ["--params", "must be > 0, got '-7e9'"]),
    (["memory", "--params", "1e30"], ["--params", "at most 1e15", "'1e30'"]),
    (["memory", "--params", "nan"], ["--params", "'nan'", "finite number > 0"]),
    (["memory", "--params", "-inf"], ["--params", "'-inf'", "finite number > 0"]),
    (["memory", "--params", "7e9", "--devices", "-1e3"], ["--devices", "got -1e3"]),
    (["memory", "--params", "7e9", "--devices", "2.5"], ["--devices", "integer", "'2.5'"]),
    (["memory", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "1e10"],
     ["--seq", "at most 1e9"]),
    (["comm", "--params", "7e9", "--devices", "1e12"], ["--devices", "at most 1e9", "1e12"]),
    (["comm", "--params", "7e9", "--link", "inf"], ["--link", "finite", "inf"]),
    (["comm", "--params", "7e9", "--link", "-5e1"], ["--link", "> 0 GB/s", "-5e1"]),
    (["plan", "--params", "7e9", "--devices", "-8"], ["--devices", "got -8"]),
    (["plan", "--params", "7e9", "--devices", "8", "--usable", "nan"], ["--usable", "nan"]),
    (["plan", "--params", "7e9", "--devices", "8", "--device-memory", "-8e10"],
     ["--device-memory", "> 0", "'-8e10'"]),
    (["plan", "--params", "7e9", "--devices", "8", "--max-bubble", "-.5"], ["--max-bubble", "-.5"]),
    (["failures", "--mtbf-hours", "inf"], ["--mtbf-hours", "got inf"]),
    (["failures", "--mtbf-hours", "1e308"], ["--mtbf-hours", "at most 1e15"]),
    (["failures", "--save-minutes", "-1e-3"], ["--save-minutes", "got -1e-3"]),
    (["failures", "--devices", "1e10"], ["--devices", "at most 1e9"]),
    (["schedule", "--stages", "-4e0"], ["--stages", "-4e0"]),
    (["schedule", "--forward-cost", "nan"], ["--forward-cost", "nan"]),
])
def test_bad_input_is_one_line_and_exit_2(fail, argv, words):
    err = fail(*argv)
    for w in words:
        assert w in err, err


# ------------------------------------------------------------------------------------
# huge inputs: a result that says what it means, never an overflow
# ------------------------------------------------------------------------------------

def test_failures_with_huge_inputs(cli):
    r = cli("failures", "--save-minutes", "1e9", "--json")
    assert r["young"]["waste_exact"] == r["daly"]["waste_exact"] == 1.0  # was OverflowError
    r = cli("failures", "--devices", "1e9", "--mtbf-hours", "1", "--json")
    assert r["devices"] == 10**9 and r["cluster_mtbf"] == pytest.approx(60 / 1e9)
    assert r["daly"]["waste_exact"] == pytest.approx(1.0)
    out = " ".join(cli("failures", "--devices", "1e9", "--mtbf-hours", "1").split())
    assert "1,000,000,000 devices, each failing every 1 hour" in out
    assert "over 100%: the first order no longer holds" in out
    assert "more than half the time is lost at any interval" in out


def test_plan_and_comm_with_a_billion_devices(cli):
    # 1e9 = 2^9 5^9: every mesh dp x tp x pp x cp (cp <= 8), found without a 1e9 loop
    r = cli("plan", "--params", "7e9", "--devices", "1e9", "--json", expect=1)
    from jaxscale.costmodel.planner import divisors
    meshes = sum(len(divisors(10**9 // (tp * cp))) for tp in divisors(10**9)
                 for cp in divisors(10**9 // tp) if cp <= 8)
    assert r["considered"] == meshes > 55 * 55 and r["recommended"] is None
    r = cli("comm", "--params", "7e9", "--devices", "1e9", "--json")
    assert r["dp"]["ring_bytes_per_device"] == pytest.approx(2 * 14e9, rel=1e-8)


def test_huge_shape_prints_in_petabytes(cli):
    out = cli("memory", "--layers", "1e6", "--hidden", "1e6", "--heads", "1", "--seq", "1e6")
    assert " PB (" in out and "PiB)" in out
    assert not re.search(r"\d{1,3}(,\d{3}){5,}", out), out  # no 18-digit GB figures


# ------------------------------------------------------------------------------------
# printed text: counts in the right number, which 7B model, no raw keys
# ------------------------------------------------------------------------------------

def test_plural():
    assert plural(1, "device") == "1 device" and plural(8, "device") == "8 devices"
    assert plural(1024, "device") == "1,024 devices" and plural(0, "step") == "0 steps"
    assert plural(1, "micro-batch") == "1 micro-batch"
    assert plural(2, "micro-batch") == "2 micro-batches"
    assert plural(50000.0, "hour") == "50,000 hours" and plural(1.0, "hour") == "1 hour"
    assert plural(3, "child", "children") == "3 children"


def _text(out: str) -> str:
    return " ".join(out.split())  # rich wraps long titles


@pytest.mark.parametrize("argv, singular", [
    (["memory", "--model", "tiny", "--devices", "1"], ["K = 1 device;", "1 sequence x 64 tokens"]),
    (["comm", "--model", "tiny", "--devices", "1", "--tp", "1", "--pp", "1", "--batch", "1"],
     ["K = 1 device,", "one step of 1 sequence x 64 tokens"]),
    (["failures", "--devices", "1", "--mtbf-hours", "1"], ["1 device, each failing every 1 hour"]),
    (["plan", "--model", "tiny", "--devices", "1", "--node-size", "1", "--batch", "1"],
     ["batch 1 sequence", "1 device a100", "nodes of 1", "1 mesh (dp x tp x pp x cp) considered"]),
])
def test_counts_of_one_are_singular(cli, argv, singular):
    out = _text(cli(*argv))
    for text in singular:
        assert text in out, out
    assert not re.search(r"\b1 (devices|sequences|tokens|layers|heads|layouts|hours)\b", out), out


@pytest.mark.parametrize("argv", [
    ["memory", "--model", "7b", "--devices", "8", "--lora-rank", "8", "--qlora"],
    ["comm", "--model", "7b", "--tp", "8", "--pp", "8"],
    ["failures"],
    ["plan", "--params", "70e9", "--devices", "64"],
])
def test_no_raw_keys_in_printed_tables(cli, argv):
    out = cli(*argv)
    keys = re.findall(r"\b[a-z0-9]+_[a-z0-9_]+\b", out)  # per_layer_gb, used_bytes ...
    assert not keys, keys


def test_which_7b_model_each_tool_means(cli, capsys):
    cfg = preset("7b")
    out = _text(cli("memory", "--model", "7b"))
    assert f"{param_count(cfg):.4g} parameters (preset 7b's count); preset 7b: 32 layers, " \
           "h = 4096, 32 heads, ffn 16384, vocab 32000" in out
    out = _text(cli("plan", "--params", "7e9", "--devices", "16", "--device-memory", "40GB"))
    assert "assumed: Llama-2-7B (32 layers, h = 4096, 32 heads, 6.74e+09 parameters)" in out
    assert "the shape's count" in out
    out = _text(cli("comm", "--model", "7b"))
    assert "preset 7b: 32 layers" in out
    with pytest.raises(SystemExit):
        cli("memory", "--help")
    assert "7b (32 layers, d_model 4096, 32 heads, d_ff 16384, vocab 32000, seq 4096; " \
           f"{param_count(cfg) / 1e9:.3g}B parameters)" in _text(capsys.readouterr().out)
