"""Single-device training: the token-weighted loss, the step, determinism, the outputs,
and progress with the time elapsed and left."""
import io
import json
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxscale import garden
from jaxscale.report import Progress
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import as_arrays, init_run, make_train_step
from jaxscale.model.loss import loss_fn
from jaxscale.training.loop import train
from jaxscale.model import config as model_config

from conftest import fp32_sum_bound

SHORT = dict(steps=30, eval_every=15, warmup=5, n_train_docs=256, n_val_docs=64)


@pytest.fixture(scope="module")
def setup():
    graphdef, params, _ = init_run(TrainConfig())
    batch = next(garden.make_corpus(0).train_batches(32))
    return graphdef, params, batch


def _log_softmax_np(logits):
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_loss_is_sum_over_tokens_divided_by_global_count(setup):
    graphdef, params, b = setup
    logits = np.asarray(nnx.merge(graphdef, params)(b.tokens), dtype=np.float64)
    nll = -np.take_along_axis(_log_softmax_np(logits), b.targets[..., None], -1)[..., 0]
    token_weighted = (nll * b.mask).sum() / b.mask.sum()
    mean_of_means = ((nll * b.mask).sum(1) / b.mask.sum(1)).mean()
    ours = float(loss_fn(graphdef, params, as_arrays(b)))
    # fp32 against float64 on the same logits: the n-token sum's rounding (conftest)
    assert ours == pytest.approx(token_weighted, rel=fp32_sum_bound(b.mask.sum()))
    # the wrong reduction really is different on variable-length documents
    assert abs(mean_of_means - token_weighted) > 100 * abs(ours - token_weighted)


@pytest.mark.parametrize("opt", [optax.adamw(3e-3), optax.sgd(0.3, momentum=0.9)])
@pytest.mark.slow
def test_step_takes_any_optax_transformation_and_learns(setup, opt):
    graphdef, params, b = setup
    step = make_train_step(graphdef, opt)
    state = opt.init(params)
    arrays = as_arrays(b)
    losses = []
    for _ in range(15):
        params, state, m = step(params, state, arrays)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.8 * losses[0]
    assert float(m["n_tokens"]) == b.n_tokens and float(m["grad_norm"]) > 0
    # single-device: nothing is spread over the 8 forced devices
    for leaf in jax.tree.leaves(params):
        assert len(leaf.sharding.device_set) == 1


@pytest.mark.slow
def test_same_seed_gives_bit_identical_loss_curve(tmp_path):
    a = train(TrainConfig(**SHORT), out_dir=tmp_path / "a", progress=False)
    b = train(TrainConfig(**SHORT), out_dir=tmp_path / "b", progress=False)
    c = train(TrainConfig(**SHORT, seed=1), progress=False)
    assert a.loss_curve == b.loss_curve and a.val_loss == b.val_loss
    assert a.loss_curve != c.loss_curve
    assert len(a.loss_curve) == len(a.grad_norms) == SHORT["steps"]
    assert a.loss_curve[-1] < a.loss_curve[0]
    assert a.val_loss > a.entropy_floor  # nothing beats the floor

    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, SHORT["steps"] + 1))
    assert all(r["grad_norm"] > 0 for r in lines)
    assert [r["step"] for r in lines if "val_loss" in r] == [15, 30]
    assert (tmp_path / "a" / "loss_curve.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "a" / "result.json").read_text())
    assert saved["loss_curve"] == a.loss_curve
    assert saved["param_count"] == model_config.param_count(model_config.preset("tiny"))


@pytest.mark.slow
def test_stop_gap_ends_training_early():
    r = train(TrainConfig(steps=400, eval_every=20, stop_gap=1.0, n_train_docs=256,
                          n_val_docs=64), progress=False)
    assert r.steps_run < 400 and r.gap <= 1.0 and r.reached_gap_at_s is not None


@pytest.mark.parametrize("change, message", [
    (dict(steps=0), "steps must be >= 1, got 0"),
    (dict(optimizer="lion"), "unknown optimizer 'lion'; choose from sgd, momentum"),
    (dict(lr=-1.0), "lr must be a positive number, got -1.0"),
    (dict(lr_schedule="step"), "unknown lr schedule 'step'"),
    (dict(model="huge"), "unknown model 'huge'"),
    (dict(n_train_docs=8), "smaller than one batch"),
])
def test_bad_train_config(change, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**change).validate()


@pytest.mark.parametrize("model", ["mid", "1b", "7b"])
def test_gpu_sized_presets_are_refused_on_cpu_devices(model):
    TrainConfig(model=model).check_platform("gpu")
    with pytest.raises(ValueError, match=f"model '{model}' is sized for GPU/TPU; on cpu "
                                         "devices use one of tiny, tiny8, small"):
        TrainConfig(model=model).check_platform("cpu")


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _progress(terminal: bool):
    from rich.console import Console

    clock, buf = _Clock(), io.StringIO()
    console = Console(file=buf, force_terminal=terminal, width=150)
    return Progress(10, label="train", clock=clock, console=console), clock, buf


def test_progress_lines_show_elapsed_and_time_left():
    bar, clock, buf = _progress(terminal=False)
    clock.t += 30
    bar.update(1, "loss 4.0")  # the first step compiled for 30 s: no estimate from it
    clock.t += 2
    bar.update(2, "loss 3.0")  # 2 s a step from here on: 8 steps, 16 s left
    clock.t += 3600
    bar.update(10, "loss 1.0")
    bar.close()
    lines = buf.getvalue().splitlines()
    assert lines == ["train 1/10 loss 4.0 | 0:30 elapsed, time left: estimating",
                     "train 2/10 loss 3.0 | 0:32 elapsed, ~0:16 left",
                     "train 10/10 loss 1.0 | 1:00:32 elapsed"]


def test_progress_bar_shows_elapsed_and_time_left():
    bar, clock, buf = _progress(terminal=True)
    clock.t += 30
    bar.update(1, "loss 4.0")
    clock.t += 2
    bar.update(2, "loss 3.0")
    bar.close()
    shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.getvalue())  # no colours
    assert "2/10 loss 3.0 0:32 elapsed, ~0:16 left" in shown, shown


def _loss_figure(monkeypatch, loss_curve, val_curve, floor=0.861):
    """plot_loss_curve's figure, caught before it is saved."""
    from types import SimpleNamespace

    from jaxscale import report
    caught = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path, dpi=110: caught.append(fig))
    result = SimpleNamespace(loss_curve=loss_curve, val_curve=val_curve, entropy_floor=floor,
                             param_count=30_752, config={"model": "tiny", "optimizer": "adamw",
                                                         "lr": 0.01, "batch_size": 32})
    report.plot_loss_curve(result, "unused.png")
    return caught[0].axes[0]


def test_loss_curve_axes_floor_and_validation_points(monkeypatch):
    """Units on both axes, the floor named on its line, validation points unlike the
    training line, and a linear axis from 0 while the losses span less than a decade."""
    ax = _loss_figure(monkeypatch, [4.6 - 0.05 * i for i in range(60)] + [float("nan")],
                      [(30, 3.0), (60, 1.36)])
    assert ax.get_xlabel() == "training step"
    assert ax.get_ylabel() == "loss (nats per token)" and ax.get_yscale() == "linear"
    assert ax.get_ylim()[0] == 0
    texts = [t.get_text() for t in ax.texts]
    assert "entropy floor 0.8610: no model can go lower" in texts
    assert "1.360" in texts  # the last validation loss, written beside its point
    train_line, val_line = ax.get_lines()[:2]
    assert list(val_line.get_xdata()) == [30, 60] and val_line.get_marker() == "D"
    assert train_line.get_marker() in ("None", "", None)
    assert train_line.get_color() != val_line.get_color()
    assert len(train_line.get_xdata()) == 60  # the NaN step is left out
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["training loss (each step's batch of 32 documents)",
                      "validation loss (held-out documents)"]


def test_loss_curve_turns_logarithmic_when_losses_span_decades(monkeypatch):
    """A run that blew up (losses 2 to 60): a log axis that says so, ticks as plain numbers."""
    ax = _loss_figure(monkeypatch, [4.6, 2.0, 60.0, 55.0], [(4, 50.0)])
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "loss (nats per token, log scale)"
    fmt = ax.yaxis.get_major_formatter()
    assert (fmt(1, 0), fmt(10, 1)) == ("1", "10")  # plain numbers, not 10^1


@pytest.mark.parametrize("model", ["tiny", "tiny-switch"])
@pytest.mark.slow
def test_the_reference_step_is_the_planned_single_device_step(model):
    """make_train_step and build_train_step(Plan()) on one device: the same parameters
    after two Adam steps, bit for bit (max abs diff 0.0), a mixture of experts included:
    both differentiate the loss plus its routers' load-balancing and z-losses, and
    report the loss alone."""
    from jaxscale.parallel.build import build_train_step
    from jaxscale.parallel.plan import Plan
    graphdef, params, _ = init_run(TrainConfig(model=model))
    opt = optax.adam(1e-2)
    batch = as_arrays(next(garden.make_corpus(0).train_batches(8, seed=1)))
    step = make_train_step(graphdef, opt)
    init, planned = build_train_step(model_config.preset(model), Plan(), opt)
    state, (p, s) = init(params), (params, opt.init(params))
    for _ in range(2):
        p, s, m = step(p, s, batch)
        state, pm = planned(state, batch)
        assert float(m["loss"]) == float(pm["loss"])
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(planned.full_params(state))):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_every_hook_closes_when_one_fails_and_the_first_error_is_raised():
    """A hook whose close raises (a profile trace that cannot be written) does not keep the
    hooks after it, the checkpoint saver among them, from closing."""
    from jaxscale.training import hooks as H
    closed = []

    class Closing(H.Hook):
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def close(self):
            closed.append(self.name)
            if self.error:
                raise self.error
    first, later = OSError("the trace cannot be written"), KeyboardInterrupt()
    with pytest.raises(OSError) as e:
        H.close_all([Closing("profiler", first), Closing("metrics"),
                     Closing("progress", later), Closing("checkpoints")])
    assert e.value is first and closed == ["profiler", "metrics", "progress", "checkpoints"]
    H.close_all([Closing("a"), Closing("b")])  # none fails: nothing raised
    assert closed[-2:] == ["a", "b"]


def test_a_setup_that_fails_after_resume_closes_the_checkpointer_and_the_metrics(
        tmp_path, monkeypatch):
    """A run whose profile folder cannot be made (a file is in the way) fails after its
    state, checkpointer and metrics.jsonl exist: both are closed on the way out (before:
    only a failure inside the resume itself closed the checkpointer)."""
    from jaxscale.training import run as runlib, setup
    from jaxscale.training.checkpoint.manager import CheckpointOptions, Checkpointer
    closed, real_open = [], runlib.open_metrics

    def tracked_metrics(path, start):
        f = real_open(path, start)
        monkeypatch.setattr(f, "close", lambda real=f.close: (closed.append("metrics"), real()))
        return f
    monkeypatch.setattr(setup, "open_metrics", tracked_metrics)
    monkeypatch.setattr(Checkpointer, "close", lambda self, real=Checkpointer.close: (
        closed.append("checkpointer"), real(self)))
    (tmp_path / "afile").write_text("x")
    cfg = TrainConfig(model="tiny", steps=2, eval_every=1000, warmup=1, n_train_docs=256,
                      n_val_docs=8)
    with pytest.raises(ValueError, match="afile exists and is not a directory"):
        train(cfg, out_dir=tmp_path / "out", progress=False, profile=tmp_path / "afile",
              checkpoint=CheckpointOptions(str(tmp_path / "ck"), every=2))
    assert sorted(closed) == ["checkpointer", "metrics"]
