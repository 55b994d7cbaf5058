"""What an evaluation gives: one `TaskResult` per (model or adapter, task), and the table the
command line prints."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TaskResult:
    task: str                      # the spec's name
    kind: str
    metric: str                    # "acc", "pass_rate", "ppl"
    value: float
    stderr: float | None = None
    n: int = 0
    extra: dict = field(default_factory=dict)     # acc_raw, mean_reward, nll, ...
    records: list[dict] = field(default_factory=list)

    def to_dict(self, records: bool = False) -> dict:
        out = {"task": self.task, "kind": self.kind, "metric": self.metric, "value": self.value,
               "stderr": self.stderr, "n": self.n, **self.extra}
        if records:
            out["records"] = self.records
        return out

    def cell(self) -> str:
        """The table's text: `62.50 +- 4.40` (percent), `80.0% (8/10)`, `PPL 12.34`."""
        if self.metric == "acc":
            err = "" if self.stderr is None or self.stderr != self.stderr else \
                f" +- {100 * self.stderr:.2f}"
            return f"{100 * self.value:.2f}{err}"
        if self.metric == "pass_rate":
            return f"{100 * self.value:.1f}% ({self.extra.get('passed', 0)}/{self.n})"
        return f"PPL {self.value:.4f}"


def saved_cell(row: dict) -> str:
    """`TaskResult.cell` of a line saved in evals.jsonl (store.save_evals); a line without a
    numeric value (written by hand, or damaged): "?"."""
    value, stderr, n = row.get("value"), row.get("stderr"), row.get("n")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "?"
    known = {"task", "kind", "metric", "value", "stderr", "n"}
    return TaskResult(str(row.get("task", "?")), str(row.get("kind", "")),
                      str(row.get("metric", "")), float(value),
                      stderr if isinstance(stderr, (int, float)) else None,
                      n if isinstance(n, int) else 0,
                      {k: v for k, v in row.items() if k not in known}).cell()


def table(results: dict[str, list[TaskResult]]) -> str:
    """One row per target, one column per task (aligned text)."""
    labels = list(results)
    names = [r.task for r in results[labels[0]]] if labels else []
    rows = [["model", *names]] + [[label, *(r.cell() for r in results[label])]
                                 for label in labels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
