"""What a step costs this engine, learnt from its own steps: a linear model of a step's
time in its shape (prefill tokens, decode sequences, context tokens read, blocks swapped
or copied, and a fixed part), fitted by least squares over the recent steps. The what-if
replays an engine's traffic with it (engine/sim/capacity.py: StepCost.seconds), so that
the time it predicts is the engine's, not two numbers typed into a form.

A step's time is the loop's: from its start to the next step's start while the engine
had work waiting (what the engine spends per step, its host work between steps
included), or to its own end when the engine went idle after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sched.output import SchedulerOutput

FEATURES = ("fixed", "prefill_token", "decode_seq", "context_token", "block_moved")
WINDOW = 4096  # steps the fit is made over (the most recent)
MIN_STEPS = 32  # fewer steps than this: no fit yet
OUTLIER_SPREADS = 5.0  # a step this many median deviations above the fit is left out


@dataclass(slots=True, frozen=True)
class StepShape:
    """What a step did, in the model's terms."""
    prefill_tokens: int = 0  # prompt tokens computed (a chunk, or a recompute)
    decode_seqs: int = 0  # requests that computed one generated token
    context_tokens: int = 0  # tokens attended to, every scheduled request's
    blocks_moved: int = 0  # swapped out or in, or copied

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        prefill = decode = context = 0
        for s in out.scheduled:
            context += s.start + s.num_new_tokens
            if s.is_decode:
                decode += 1
            else:
                prefill += s.num_new_tokens
        return cls(prefill, decode, context,
                   len(out.swap_out) + len(out.swap_in) + len(out.copies))

    def row(self) -> tuple[float, ...]:
        return (1.0, self.prefill_tokens, self.decode_seqs, self.context_tokens,
                self.blocks_moved)


@dataclass(slots=True, frozen=True)
class StepCost:
    """The time of one step (ms): a fixed part, plus a cost per prompt token computed,
    per decode sequence (the per-token cost when not given: a batched token's), per
    context token read and per block swapped or copied. The one formula of a step's
    time: the replays' (engine/sim/capacity.py) and the fit's."""
    base_ms: float = 10.0
    per_token_ms: float = 0.05
    decode_seq_ms: float | None = None
    context_token_ms: float = 0.0
    block_moved_ms: float = 0.0

    def seconds(self, shape: StepShape) -> float:
        decode_ms = self.per_token_ms if self.decode_seq_ms is None else self.decode_seq_ms
        return (self.base_ms + self.per_token_ms * shape.prefill_tokens
                + decode_ms * shape.decode_seqs + self.context_token_ms * shape.context_tokens
                + self.block_moved_ms * shape.blocks_moved) / 1000.0

    def as_dict(self) -> dict:
        return {"step_base_ms": self.base_ms, "step_token_ms": self.per_token_ms,
                "step_decode_seq_ms": self.decode_seq_ms,
                "step_context_token_ms": self.context_token_ms,
                "step_block_ms": self.block_moved_ms}

    @classmethod
    def from_dict(cls, d: dict) -> StepCost:
        return cls(d["step_base_ms"], d["step_token_ms"], d.get("step_decode_seq_ms"),
                   d.get("step_context_token_ms") or 0.0, d.get("step_block_ms") or 0.0)


DEFAULT_COST = StepCost()  # (a what-if's before an engine has a fit)


@dataclass(slots=True, frozen=True)
class StepCostFit:
    """A step cost fitted to an engine's steps, and how well it fits them: the rms of
    the residuals and the mean step (ms), over `steps` steps."""
    cost: StepCost
    rms_ms: float
    mean_ms: float
    steps: int

    def as_dict(self) -> dict:
        return {**self.cost.as_dict(), "rms_ms": self.rms_ms, "mean_ms": self.mean_ms,
                "steps": self.steps}


class StepCostModel:
    """Recent steps' shapes and times; fit() the least-squares model over them, each
    coefficient at least 0 (time never shrinks as a step does more), steps far slower
    than their shape's fit left out."""

    def __init__(self, window: int = WINDOW) -> None:
        self._x = np.zeros((window, len(FEATURES)))
        self._y = np.zeros(window)
        self._n = 0  # steps recorded, ever
        self._pending: tuple[StepShape, float] | None = None  # (shape, start): busy after
        self._fit: StepCostFit | None = None
        self._fit_at = -1  # _n when _fit was made

    def record(self, shape: StepShape, seconds: float) -> None:
        i = self._n % len(self._y)
        self._x[i] = shape.row()
        self._y[i] = seconds * 1000.0
        self._n += 1

    def step_started(self, started: float) -> None:
        """A step starts at `started`: the one before, if the engine had work waiting
        after it, took until now."""
        if self._pending is not None:
            shape, start = self._pending
            self._pending = None
            self.record(shape, started - start)

    def step_ended(self, shape: StepShape, started: float, ended: float, busy: bool) -> None:
        """A step of this shape ran from started to ended; busy: work is waiting, so the
        next step follows at once (its start ends this one's time)."""
        if busy:
            self._pending = (shape, started)
        else:
            self.record(shape, ended - started)

    def fit(self) -> StepCostFit | None:
        if self._n < MIN_STEPS:
            return None
        if self._fit_at == self._n:
            return self._fit
        n = min(self._n, len(self._y))
        x, y = self._x[:n], self._y[:n]
        coef = _nonnegative_fit(x, y)
        # Steps stretched by something else (a pause of the process, a busy machine)
        # are not what their shape costs: those far above the fit go, and it is made again.
        residual = y - x @ coef
        spread = np.median(np.abs(residual - np.median(residual)))
        typical = residual <= np.median(residual) + OUTLIER_SPREADS * max(spread, 1e-3)
        if typical.sum() >= MIN_STEPS and not typical.all():
            coef = _nonnegative_fit(x[typical], y[typical])
            residual = y - x @ coef
        self._fit = StepCostFit(StepCost(*(float(c) for c in coef)),
                                rms_ms=float(np.sqrt(np.mean(residual ** 2))),
                                mean_ms=float(y.mean()), steps=n)
        self._fit_at = self._n
        return self._fit


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient at least 0: a feature whose free fit is
    negative is dropped and the rest fitted again (a feature that never varies is
    the fixed part's, and left out)."""
    active = [j for j in range(x.shape[1]) if j == 0 or np.any(x[:, j] != x[0, j])]
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if solution.min() >= 0 or len(active) == 1:
            coef[active] = np.maximum(solution, 0.0)
            break
        active.pop(int(np.argmin(solution)))  # the most negative goes
    return coef
