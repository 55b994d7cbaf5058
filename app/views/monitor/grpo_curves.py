"""The Monitor's Rewards page for GRPO runs: how the reward grows, live.

Four plots, fed with the run's step and eval events ("kind": "grpo", see
app.engine.training.grpo) from the same RunTail as the loss curves and drawn through the
Monitor's PacedRedraw and RunRanges:

* Reward: the weighted total reward per step, mean (raw and smoothed) with a +-1 std band,
  and the held-out reward (greedy completions of the held-out prompts) at every evaluation;
  compared runs are overlaid here (`overlay`);
* Functions: each reward function's mean (raw values, before weighting);
* Share: of the prompt groups whose completions all scored the same ("zero spread": they
  teach nothing) and of the completions cut off at max_new_tokens ("clipped");
* Completion length in tokens: the mean within the min..max band.

Test-visible state: `reward_curve`, `reward_smooth_curve`, `reward_band` (`.lower`/`.upper`),
`eval_reward_curve`, `function_curves` {name: curve}, `zero_spread_curve`, `clipped_curve`,
`length_curve`, `length_band`.
"""

from __future__ import annotations

from collections.abc import Callable

import pyqtgraph as pg
from PySide6.QtWidgets import QGridLayout, QVBoxLayout, QWidget

from app.views.widgets.plots import (ACCENT, LEGEND, ORANGE, PALETTE, RAW, Band, RunRanges,
                                     num, small_plot, tint, title_with_keys)
from app.views.widgets.run_tail import PacedRedraw, Series, clock

KEYS = ("reward", "functions", "fractions", "length")
FUNCTIONS_TITLE = "Functions:"


def function_color(i: int) -> str:
    """The colour of the i-th reward function's curve (in the current theme)."""
    return tint(PALETTE[(i + 1) % len(PALETTE)]).name()


class GrpoCurves(QWidget):
    """See the module docstring. `smoothing()` gives the EMA weight of the smoothed reward;
    `overlay(plot, weight)` draws other runs' curves on the reward plot and returns their
    values (for the range)."""

    def __init__(self, redraw: PacedRedraw, ranges: RunRanges,
                 smoothing: Callable[[], float], overlay: Callable[..., list],
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.ranges, self.smoothing, self.overlay = ranges, smoothing, overlay
        # step, reward mean, reward std, zero spread, clipped, length mean, min, max
        self._steps = Series(8)
        self._evals = Series(2)                       # step, held-out reward mean
        self._functions: dict[str, Series] = {}       # name -> (step, mean)

        self.reward_title = "Reward (weighted total per completion)"
        self.reward_plot = small_plot(self.reward_title, "reward", grid=True)
        self.reward_plot.setMinimumHeight(160)   # with the three below: fits a 720 px window
        self.reward_plot.addLegend(offset=(-10, -10), **LEGEND)   # bottom right: the
                                                                  # reward rises away from it
        self.reward_band = Band(self.reward_plot, ACCENT, alpha=35, name="\u00b1 1 std")
        self.reward_curve = self.reward_plot.plot(pen=pg.mkPen(RAW, width=1), name="mean",
                                                  connect="finite")
        self.reward_smooth_curve = self.reward_plot.plot(pen=pg.mkPen(ACCENT, width=2),
                                                         name="mean (smoothed)",
                                                         connect="finite")
        self.eval_reward_curve = self.reward_plot.plot(
            pen=pg.mkPen(ORANGE, width=2), symbol="o", symbolSize=6, symbolBrush=ORANGE,
            symbolPen=None, name="held-out (greedy)")

        self.functions_plot = small_plot(FUNCTIONS_TITLE, "mean reward")
        self.function_curves: dict[str, pg.PlotDataItem] = {}
        self.fractions_plot = small_plot("", "share")
        title_with_keys(self.fractions_plot, "Share:", [("zero spread", ACCENT),
                                                        ("clipped", PALETTE[0])])
        self.zero_spread_curve = self.fractions_plot.plot(pen=pg.mkPen(ACCENT, width=1.5),
                                                          connect="finite")
        self.clipped_curve = self.fractions_plot.plot(pen=pg.mkPen(PALETTE[0], width=1.5),
                                                      connect="finite")
        self.length_plot = small_plot("Completion length", "tokens")
        self.length_band = Band(self.length_plot, ACCENT)
        self.length_curve = self.length_plot.plot(pen=pg.mkPen(ACCENT, width=1.5),
                                                  connect="finite")
        for plot in (self.reward_plot, self.functions_plot, self.length_plot):
            ranges.watch(plot)
        ranges.watch(self.fractions_plot, y=(0, 1))
        for key in KEYS:
            redraw.add(key, getattr(self, f"_draw_{key}"))

        grid = QGridLayout()
        for i, plot in enumerate((self.functions_plot, self.fractions_plot, self.length_plot)):
            grid.addWidget(plot, 0, i)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        layout.addWidget(self.reward_plot, 3)
        layout.addLayout(grid, 2)

    # ---------------------------------------------------------------- data
    def clear(self) -> None:
        self._steps.clear()
        self._evals.clear()
        for name in list(self.function_curves):
            self.functions_plot.removeItem(self.function_curves.pop(name))
        self._functions.clear()
        title_with_keys(self.functions_plot, FUNCTIONS_TITLE, [])

    def add_steps(self, events: list) -> None:
        self._steps.extend([(e.get("step", 0), num(e, "reward_mean"), num(e, "reward_std"),
                             num(e, "zero_spread_fraction"), num(e, "completion_clipped_fraction"),
                             num(e, "completion_len_mean"), num(e, "completion_len_min"),
                             num(e, "completion_len_max")) for e in events])
        rows: dict[str, list] = {}
        for e in events:
            for name, stats in (e.get("rewards") or {}).items():
                rows.setdefault(name, []).append((e.get("step", 0), num(stats, "mean")))
        for name, values in rows.items():
            if name not in self._functions:
                self._functions[name] = Series(2)
                pen = pg.mkPen(function_color(len(self.function_curves)), width=1.5)
                self.function_curves[name] = self.functions_plot.plot(pen=pen, connect="finite")
                title_with_keys(self.functions_plot, FUNCTIONS_TITLE, [
                    (n, function_color(i)) for i, n in enumerate(self.function_curves)])
            self._functions[name].extend(values)

    def add_evals(self, events: list) -> None:
        self._evals.extend([(e.get("step", 0), num(e, "reward_mean")) for e in events])

    def stats(self, ev: dict) -> list[str]:
        """The status line's parts for the last step event `ev`."""
        parts = [f"reward {num(ev, 'reward_mean'):.3f} \u00b1 {num(ev, 'reward_std'):.3f}"]
        if self._evals.n:
            parts.append(f"held-out {self._evals.col(1)[-1]:.3f}")
        parts += [f"zero spread {100 * num(ev, 'zero_spread_fraction'):.0f}%",
                  f"length {num(ev, 'completion_len_mean'):.1f}", f"lr {num(ev, 'lr'):.2e}",
                  f"{num(ev, 'step_s'):.2f} s/step", f"elapsed {clock(ev.get('elapsed_s'))}"]
        return parts

    # ---------------------------------------------------------------- drawing
    def _draw_reward(self) -> None:
        s, weight = self._steps, self.smoothing()
        x, mean, std = s.col(0), s.col(1), s.col(2)
        self.reward_curve.setData(x, mean)
        self.reward_smooth_curve.setData(x, s.smoothed(weight))
        self.reward_band.set_data(x, mean - std, mean + std)
        self.eval_reward_curve.setData(self._evals.col(0), self._evals.col(1))
        ys = [mean - std, mean + std, self._evals.col(1)]
        self.ranges.fit(self.reward_plot, ys + self.overlay(self.reward_plot, weight))

    def _draw_functions(self) -> None:
        for name, series in self._functions.items():
            self.function_curves[name].setData(series.col(0), series.col(1))
        self.ranges.fit(self.functions_plot, [s.col(1) for s in self._functions.values()])

    def _draw_fractions(self) -> None:
        x = self._steps.col(0)
        self.zero_spread_curve.setData(x, self._steps.col(3))
        self.clipped_curve.setData(x, self._steps.col(4))
        self.ranges.fit(self.fractions_plot, [])

    def _draw_length(self) -> None:
        x = self._steps.col(0)
        self.length_curve.setData(x, self._steps.col(5))
        self.length_band.set_data(x, self._steps.col(6), self._steps.col(7))
        self.ranges.fit(self.length_plot, [self._steps.col(7)], from_zero=True)
