"""`jaxscale memory`, `comm` and `failures`: --json figures against the lectures' numbers,
human tables, --help, and bad input as one line with exit code 2."""

import pytest

from jaxscale.cli import main
from jaxscale.model import param_count, preset

GIB = 2**30


@pytest.fixture
def fail(capsys):

    def run(*argv):
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2, err
        assert len(err.splitlines()) == 1 and err.startswith("jaxscale: error: "), err
        return err
    return run


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
    assert "244.81 GB" in out and "per-layer recomputation" in out and "LoRA" in out


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
    (["comm", "--params", "7e9", "--grad-bytes", "0"], ["--grad-bytes", "got 0"]),
    (["failures", "--devices", "0"], ["--devices", "got 0"]),
    (["failures", "--save-minutes", "-1"], ["--save-minutes", "-1"]),
    (["failures", "--mtbf-hours", "0"], ["--mtbf-hours", "> 0"]),
    (["failures", "--restart-minutes", "-2"], ["--restart-minutes", ">= 0"]),
    (["plan", "--params", "70e9", "--devices", "64", "--device-memory", "80XB"],
     ["--device-memory", "'80XB'", "80GB"]),
    (["plan", "--params", "70e9", "--devices", "12"], ["--devices 12", "--node-size 8"]),
    (["plan", "--devices", "64"], ["--params"]),
    (["plan", "--params", "7e9", "--devices", "8", "--layers", "32", "--hidden", "4096",
      "--heads", "30"], ["--hidden 4096", "--heads 30"]),
    (["plan", "--params", "7e9", "--devices", "8", "--usable", "1.5"], ["--usable 1.5", "(0, 1]"]),
    (["plan", "--params", "7e9", "--devices", "8", "--max-bubble", "1"], ["--max-bubble 1"]),
    (["plan", "--params", "7e9", "--devices", "8", "--intra-link", "pcie"], ["'pcie'", "nvlink"]),
])
def test_bad_input_is_one_line_and_exit_2(fail, argv, words):
    err = fail(*argv)
    for w in words:
        assert w in err, err
