"""Failures and checkpoints: how often a big cluster breaks and how often to save.

Every formula takes times in one unit of your choice (the CLI uses minutes) and assumes
failures arrive independently at a constant rate (exponential times between failures).

  cluster MTBF         M = M_device / N        (any one of N devices failing stops the job)
  Young (1974)         every tau of work, save for delta; a failure loses on average tau/2
                       of work plus the restart R, so the wasted fraction is, to first order,
                           W(tau) ~ delta/tau + (tau/2 + R)/M
                       dW/dtau = -delta/tau^2 + 1/(2M) = 0   =>   tau* = sqrt(2 delta M),
                       W(tau*) = sqrt(2 delta/M) + R/M
  Daly (2006)          the next-order correction for delta not << M:
                           tau* = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + delta/(18M)] - delta
                       (tau* = M once delta >= 2M), and the exact expected time of a segment of
                       tau work + delta save under exponential failures with restart R:
                           E = M e^(R/M) (e^((tau+delta)/M) - 1),   waste = 1 - tau/E
  asynchronous save    training stops only for a snapshot (delta_b, e.g. a copy to host
                       memory); the write to storage (delta_w) runs in the background, and
                       until it is done the previous checkpoint is the one to restart from:
                           W ~ delta_b/tau + (tau/2 + delta_w + R)/M
                       tau* = sqrt(2 delta_b M) (delta_w does not move it, but tau >= delta_w
                       so that writes do not pile up) and W(tau*) = sqrt(2 delta_b/M) +
                       (delta_w + R)/M. Lecture 13 exercise 9 takes delta_b = delta/10 and
                       ignores delta_w.
"""
from __future__ import annotations

import math

from jaxscale.costmodel import CostModelError


def _positive(allow_zero: tuple[str, ...] = (), **values: float) -> None:
    for name, v in values.items():
        ok = v >= 0 if name in allow_zero else v > 0
        if not (ok and math.isfinite(v)):
            need = ">= 0" if name in allow_zero else "> 0"
            raise CostModelError(f"{name} must be a finite number {need}, got {v}")


def cluster_mtbf(device_mtbf: float, devices: int) -> float:
    """Mean time between failures of the whole job: one device's MTBF / N."""
    _positive(device_mtbf=device_mtbf, devices=devices)
    return device_mtbf / devices


def young_interval(save: float, mtbf: float) -> float:
    """Young's optimal work between checkpoints, sqrt(2 * save * MTBF)."""
    _positive(save=save, mtbf=mtbf)
    return math.sqrt(2 * save * mtbf)


def first_order_waste(interval: float, save: float, mtbf: float, restart: float = 0.0,
                      write: float = 0.0) -> float:
    """Young's wasted fraction save/tau + (tau/2 + write + restart)/MTBF at any interval tau.

    `write` is the background write of an asynchronous checkpoint (0 for a blocking one).
    """
    _positive(("restart", "write"), interval=interval, save=save, mtbf=mtbf,
              restart=restart, write=write)
    return save / interval + (interval / 2 + write + restart) / mtbf


def daly_interval(save: float, mtbf: float) -> float:
    """Daly's higher-order optimal interval (work between checkpoints)."""
    _positive(save=save, mtbf=mtbf)
    if save >= 2 * mtbf:
        return mtbf
    x = save / (2 * mtbf)
    return math.sqrt(2 * save * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - save


def expected_waste(interval: float, save: float, mtbf: float, restart: float = 0.0) -> float:
    """Exact wasted fraction under exponential failures (Daly's model): 1 - tau / E[time].

    Computed through log E, so that a segment many MTBFs long (E beyond any float) gives a
    waste of 1 instead of an overflow.
    """
    _positive(("restart",), interval=interval, save=save, mtbf=mtbf, restart=restart)
    x = (interval + save) / mtbf
    if x > 1:  # log(e^x - 1) = x + log(1 - e^-x), which never overflows
        log_expm1 = x + math.log1p(-math.exp(-x))
    elif x > 0:
        log_expm1 = math.log(math.expm1(x))
    else:  # (tau + delta) / M underflowed to 0: e^x - 1 = x, taken in logs
        log_expm1 = math.log(interval + save) - math.log(mtbf)
    log_segment = math.log(mtbf) + restart / mtbf + log_expm1
    return 1 - math.exp(math.log(interval) - log_segment)


def checkpoint_plan(devices: int, device_mtbf: float, save: float, restart: float = 0.0,
                    async_blocking: float | None = None, async_write: float | None = None) -> dict:
    """Every figure of a checkpointing decision, all times in the unit of the inputs.

    async_blocking defaults to save/10 (lecture 13 exercise 9), async_write to save (the
    background write takes as long as the blocking save did).
    """
    m = cluster_mtbf(device_mtbf, devices)
    _positive(("restart",), save=save, restart=restart)
    blocking = save / 10 if async_blocking is None else async_blocking
    write = save if async_write is None else async_write
    _positive(("async_write",), async_blocking=blocking, async_write=write)
    young, daly = young_interval(save, m), daly_interval(save, m)
    a_tau = young_interval(blocking, m)
    plan = {
        "devices": devices, "device_mtbf": device_mtbf, "cluster_mtbf": m,
        "save": save, "restart": restart,
        "young": {"interval": young,
                  "waste_first_order": first_order_waste(young, save, m, restart),
                  "waste_exact": expected_waste(young, save, m, restart)},
        "daly": {"interval": daly, "waste_exact": expected_waste(daly, save, m, restart)},
        "async": {"blocking": blocking, "write": write, "interval": a_tau,
                  "waste_write_ignored": first_order_waste(a_tau, blocking, m, restart),
                  "waste_with_write": first_order_waste(a_tau, blocking, m, restart, write),
                  "interval_covers_write": a_tau >= write},
    }
    _check_finite(plan, f"devices={devices}, device MTBF={device_mtbf:g}, save={save:g}, "
                        f"restart={restart:g}")
    return plan


def _check_finite(figures: dict, inputs: str) -> None:
    """Refuse inputs so extreme that a figure is no longer a finite float."""
    for key, v in figures.items():
        if isinstance(v, dict):
            _check_finite(v, inputs)
        elif isinstance(v, float) and not math.isfinite(v):
            raise CostModelError(f"{inputs}: the {key} comes out as {v}; these inputs are "
                                 "beyond what the formulas can compute in floating point, "
                                 "choose less extreme ones")
