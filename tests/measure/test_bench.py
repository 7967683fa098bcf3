"""jaxscale bench: its arithmetic, the figures it prints, --profile, and bad input."""
import math

import jax.numpy as jnp
import pytest

from jaxscale import bench
from jaxscale.model import flops
from jaxscale.measure import hardware
from jaxscale.runtime import profiling
from jaxscale.runtime.devices import DeviceError, pick_devices
from jaxscale.model import config as model_config


@pytest.fixture(scope="module")
def peak(devices):
    return hardware.measure_matmul_peak(devices[0], n=256, iters=2, repeats=2)


@pytest.fixture(scope="module")
def tiny(devices, peak, tmp_path_factory):
    where = tmp_path_factory.mktemp("bench-profile")
    cfg = bench.BenchConfig("tiny", batch_size=8, steps=3, warmup=1)
    return bench.run(cfg, devices[0], peak, profiling.Profiler(where)), where


@pytest.mark.slow
def test_rates_and_mfu_follow_from_the_measured_step(tiny, peak):
    r, _ = tiny
    assert len(r.step_s_all) == 3 and r.step_s == sorted(r.step_s_all)[1]
    assert r.tokens_per_s == pytest.approx(8 * 64 / r.step_s)
    count = flops.model_flops_per_token(model_config.preset("tiny"))
    assert r.flops == count
    assert r.achieved_flops_per_s == pytest.approx(count.total * r.tokens_per_s)
    assert r.mfu_matmul == pytest.approx(r.achieved_flops_per_s / peak.flops_per_s)
    assert r.datasheet_peak is None and r.mfu_datasheet is None  # no datasheet for a CPU
    assert r.compute_dtype == "float32" and r.compile_s > 0


@pytest.mark.slow
def test_the_trace_holds_the_timed_steps_and_not_the_compile(tiny):
    r, where = tiny
    steps = profiling.step_times(where)
    assert steps is not None and len(steps) == 3
    assert all(0 < s <= 1e3 * max(r.step_s_all) * 1.5 + 5 for s in steps)
    assert profiling.top_ops(where)


@pytest.mark.slow
def test_xla_sees_one_scanned_layer_and_every_unrolled_one(devices, peak, tiny):
    """XLA's cost analysis counts a while loop's body once: with the layers scanned it sees
    a fraction of the model FLOPs, unrolled it sees them all (plus elementwise work)."""
    scanned, _ = tiny
    unrolled = bench.run(bench.BenchConfig("tiny", 8, unroll=True, steps=1, warmup=0),
                         devices[0], peak)
    total = scanned.flops.total
    assert scanned.xla_flops_per_token < 0.8 * total < unrolled.xla_flops_per_token
    assert unrolled.xla_flops_per_token <= 1.5 * total


@pytest.mark.parametrize("change, message", [
    (dict(batch_size=0), "batch_size must be >= 1"),
    (dict(steps=0), "steps must be >= 1"),
    (dict(warmup=-1), "warmup must be >= 0"),
    (dict(model="huge"), "unknown model 'huge'"),
    (dict(attention="cudnn"), "cuDNN flash attention takes bf16 or fp16"),
])
def test_bad_bench_config(change, message):
    with pytest.raises(ValueError, match=message):
        bench.BenchConfig(**change).validate()


@pytest.mark.slow
def test_bench_json_has_every_figure_it_prints(cli):
    out = cli("bench", "--model", "tiny", "--batch", "4,8", "--steps", "2", "--warmup", "0",
              "--json")
    assert out["platform"] == "cpu" and out["matmul_peak"]["flops_per_s"] > 0
    assert [r["config"]["batch_size"] for r in out["rows"]] == [4, 8]
    for r in out["rows"]:
        assert r["tokens_per_s"] > 0 and 0 < r["mfu_matmul"] < 5
        assert math.isfinite(r["flops"]["total"]) and r["config"]["attention"] == "einsum"
    assert "6N" in out["convention"]


@pytest.mark.slow  # compiles a bf16 step
def test_the_matmul_peak_is_measured_in_the_steps_compute_dtype(cli, monkeypatch):
    """A bf16 step's MFU divides by a bf16 matmul's rate, not the platform's default (fp32
    on CPU): the peak is measured in the precision policy's compute dtype."""
    real, asked = hardware.measure_matmul_peak, []

    def small_peak(device=None, dtype=None, **_):
        asked.append(dtype)
        return real(device, dtype, n=64, iters=2, repeats=1)
    monkeypatch.setattr(hardware, "measure_matmul_peak", small_peak)
    out = cli("bench", "--model", "tiny", "--batch", "4", "--steps", "1", "--warmup", "0",
              "--precision", "bf16", "--json")
    assert [jnp.dtype(d).name for d in asked] == ["bfloat16"]
    assert out["matmul_peak"]["dtype"] == "bfloat16"
    assert out["rows"][0]["compute_dtype"] == "bfloat16"


@pytest.mark.parametrize("argv, words", [
    (["--batch", "0"], ["--batch", "got 0"]),
    (["--batch", "4,4"], ["batch given twice"]),
    (["--remat", "most"], ["unknown remat policy 'most'", "none, full, matmuls"]),
    (["--model", "mid"], ["'mid' is sized for GPU/TPU"]),
    (["--platform", "gpu"], ["--platform gpu: no gpu devices here"]),
    (["--attention", "cudnn"], ["--attention cudnn: cuDNN flash attention runs on NVIDIA GPUs"]),
    (["--precision", "fp64"], ["'fp64'"]),
    (["--target", "v5e-4"], ["--target only compiles: add --abstract"]),
    (["--abstract", "--target", "a100-8"], ["unknown target 'a100-8'", "v5e-16"]),
    (["--abstract", "--profile", "p"], ["--abstract runs none"]),
])
def test_bad_bench_input_is_one_line_and_exit_2(capsys, argv, words):
    from jaxscale.cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err


def test_pick_devices_names_the_platforms_and_what_is_present(devices):
    assert pick_devices("cpu", 8) == devices and pick_devices("auto") == devices
    with pytest.raises(DeviceError, match="unknown platform 'metal'; choose from auto, cpu, "
                                          "gpu, tpu"):
        pick_devices("metal")
    with pytest.raises(DeviceError, match="--platform tpu: no tpu devices here"):
        pick_devices("tpu", 1)


@pytest.mark.slow
def test_train_profile_traces_the_steps_after_the_compiling_one(cli, tmp_path):
    out = cli("train", "--model", "tiny", "--steps", "4", "--eval-every", "4", "--batch-size",
              "8", "--out", str(tmp_path / "run"), "--profile", str(tmp_path / "prof"), "--json")
    assert out["steps_run"] == 4
    assert len(profiling.step_times(tmp_path / "prof")) == 3  # steps 2-4: step 1 compiles


def test_the_datasheet_column_follows_the_compute_dtype_and_the_platform():
    """fp32 matmuls on an NVIDIA GPU run as TF32 under XLA's default precision: MFU is
    taken against the TF32 figure there, never against the plain fp32 one (it would pass
    100%)."""
    import jax.numpy as jnp
    assert bench.peak_dtype(jnp.float32, "gpu") == "tfloat32"
    assert bench.peak_dtype(jnp.float32, "cpu") == "float32"
    assert bench.peak_dtype(jnp.bfloat16, "gpu") == "bfloat16"
    assert hardware.datasheet_peak("NVIDIA H200", bench.peak_dtype(jnp.bfloat16, "gpu")) == 989e12


@pytest.mark.slow
def test_an_fp8_bench_on_the_cpu_says_it_is_an_emulation(cli):
    out = cli("bench", "--model", "tiny", "--batch", "4", "--steps", "1", "--warmup", "0",
              "--precision", "fp8", "--json")
    assert out["rows"] and "emulated on the CPU" in out["fp8"]
    assert cli("bench", "--model", "tiny", "--batch", "4", "--steps", "1", "--warmup", "0",
               "--json")["fp8"] is None


@pytest.mark.slow
def test_an_abstract_bench_compiles_each_row_and_runs_none(cli):
    """--abstract on this CPU: each row's step compiled on abstract state and never run.
    Its arguments are the state the step builds (parameters, Adam's moments and count)
    and the batch, to the byte; a CPU has no datasheet, so no floor under the step time."""
    import jax
    from flax import nnx

    from jaxscale.model import optim, transformer as modellib
    from jaxscale.parallel.build import build_train_step
    from jaxscale.parallel.plan import Plan
    out = cli("bench", "--abstract", "--model", "tiny", "--batch", "4", "--remat", "none,full",
              "--json")
    assert out["target"] is None and out["platform"] == "cpu" and len(out["rows"]) == 2
    cfg = model_config.preset("tiny")
    init, _ = build_train_step(cfg, Plan(), optim.adamw(1e-4), jax.devices()[:1])
    state = jax.eval_shape(init, nnx.to_pure_dict(nnx.state(modellib.abstract(cfg), nnx.Param)))
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    for r in out["rows"]:
        assert r["memory"]["arguments"] == held + 3 * 4 * 4 * cfg.seq_len  # tokens, targets, mask
        assert r["needed_bytes"] > r["memory"]["arguments"] and r["fits"] is None
        assert r["datasheet_peak"] is None and r["step_s_at_peak"] is None
        assert r["flops_per_token"] == flops.model_flops_per_token(cfg).total
    none, full = out["rows"]
    assert full["xla_flops_per_token"] > none["xla_flops_per_token"]  # the recomputed forward

