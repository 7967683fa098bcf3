"""`jaxscale memory` with a parallel layout: every paper figure from the command line, --json."""

import pytest


GPT3 = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048",
        "--vocab", "51200"]




def test_korthikanti_175b_from_the_command_line(cli):
    r = cli("memory", *GPT3, "--tp", "8", "--sequence-parallel", "--pp", "8",
            "--recompute", "selective", "--json")
    k, sbh = r["layout"]["korthikanti"], 2048 * 12288
    assert k["eq1_no_parallelism"] == pytest.approx(sbh * (34 + 80))
    assert k["eq2_tensor_parallel"] == pytest.approx(sbh * 23)
    assert k["eq4_tensor_sequence_parallel"] == pytest.approx(sbh * 114 / 8)
    assert k["tp_sp_selective_recompute"] == pytest.approx(sbh * 34 / 8)
    assert k["full_recompute"] == 2 * sbh
    assert round(k["eq2_tensor_parallel"] / k["tp_sp_selective_recompute"]) == 5  # headline
    a = r["layout"]["activations"]  # eq. 6: 34 s b h L / t on the first stage
    assert a["total"] == pytest.approx(34 * sbh * 96 / 8) and a["in_flight"] == 8
    st = r["layout"]["states"][0]
    assert st["total"] == pytest.approx(16 * 96 * 12 * 12288**2 / 64 + 16 * 51200 * 12288 / 64)


def test_bare_recompute_is_full_and_interleaving_adds_its_factor(cli):
    r = cli("memory", *GPT3, "--tp", "8", "--pp", "8", "--recompute", "--json")
    assert r["layout"]["recompute"] == "full"
    assert r["activations"]["used"] == "recompute"
    a = r["layout"]["activations"]
    assert a["stored"] == 2 * 2048 * 12288 * 12 * 8 and a["working_layer"] > 0
    plain = cli("memory", *GPT3, "--tp", "8", "--pp", "8", "--json")["layout"]["activations"]
    inter = cli("memory", *GPT3, "--tp", "8", "--pp", "8", "--virtual", "3",
                "--json")["layout"]["activations"]
    assert inter["total"] == pytest.approx(plain["total"] * (1 + 7 / 24))


def test_max_model_reproduces_zero_table2(cli):
    r = cli("memory", "--params", "1e9", "--devices", "64", "--max-model",
            "--device-memory", "32GB", "--json")
    got = [round(x["params"] / 1e9, 1) for x in r["layout"]["max_model"]]
    assert got == [2.0, 7.6, 14.4, 128.0]
    r = cli("memory", "--params", "1e9", "--devices", "64", "--tp", "4", "--max-model",
            "--device-memory", "32GB", "--json")  # MP = 4 on 256 GPUs: 8B ... 0.5T
    assert [round(x["params"] / 1e9) for x in r["layout"]["max_model"]] == [8, 31, 58, 512]


def test_budgets_offload_and_the_gathered_layer(cli):
    r = cli("memory", "--model", "7b", "--devices", "8", "--bytes-per-param", "adam8bit",
            "--offload", "optimizer", "--json")
    n = r["params"]
    z0, z3 = r["layout"]["states"][0], r["layout"]["states"][3]
    assert z0["optimizer"] == 0 and z0["cpu"] == pytest.approx(6 * n)
    assert z0["total"] == pytest.approx(4 * n)
    assert z3["gathered_layer"] > 0 and z3["cpu"] == pytest.approx(6 * n / 8)
    fp8 = cli("memory", "--params", "1e9", "--bytes-per-param", "fp8", "--json")
    assert fp8["layout"]["states"][0]["total"] == 11e9


def test_deepspeed_estimator_option(cli):
    r = cli("memory", "--model", "7b", "--devices", "16", "--deepspeed", "--json")
    rows = {(x["stage"], x["offload"]): x for x in r["layout"]["deepspeed"]["rows"]}
    n = r["params"]
    assert rows[(2, "none")]["gpu_per_device"] == pytest.approx(4 * n + int(16 * n / 16))
    assert rows[(3, "params")]["cpu_per_node"] == pytest.approx(int(18 * n / 2 * 1.5), abs=1)
    out = cli("memory", "--model", "7b", "--devices", "16", "--deepspeed")
    assert "DeepSpeed's estimator" in out


@pytest.mark.parametrize("argv, words", [
    (["memory", *GPT3, "--tp", "5"], ["--tp 5", "96 heads"]),
    (["memory", *GPT3, "--pp", "7"], ["--pp 7", "96 layers"]),
    (["memory", *GPT3, "--cp", "3"], ["--cp 3", "2048"]),
    (["memory", "--params", "7e9", "--tp", "-2"], ["--tp", "-2"]),
    (["memory", "--params", "7e9", "--sequence-parallel"], ["--sequence-parallel", "--tp 2"]),
    (["memory", "--params", "7e9", "--max-model"], ["--max-model", "--device-memory"]),
    (["memory", "--params", "7e9", "--max-model", "--device-memory", "80XB"],
     ["'80XB'", "80GB"]),
    (["memory", "--params", "7e9", "--bytes-per-param", "fp4"], ["'fp4'", "mixed-adam"]),
    (["memory", "--params", "7e9", "--recompute", "some"], ["'some'", "selective"]),
    (["memory", *GPT3, "--kv-heads", "7"], ["--kv-heads 7", "--heads 96"]),
    (["memory", "--params", "0"], ["--params", "> 0"]),
    (["plan", "--params", "7e9", "--devices", "8", "--device", "h900"], ["'h900'", "h100"]),
    (["plan", "--params", "7e9", "--devices", "8", "--fix", "pipe=2"], ["'pipe=2'", "dp=1"]),
    (["plan", "--params", "7e9", "--devices", "8", "--zero-choices", "5"], ["'5'", "0, 1, 2, 3"]),
    (["plan", "--params", "7e9", "--devices", "8", "--efficiency", "1.5"], ["--efficiency 1.5"]),
    (["plan", "--params", "7e9", "--devices", "-8"], ["--devices", "-8"]),
])
def test_bad_input_one_line_exit_2(fail, argv, words):
    err = fail(*argv)
    for w in words:
        assert w in err, err
