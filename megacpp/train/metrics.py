"""Run metrics: one JSON object per line, TensorBoard scalars, and a loss-curve PNG at the end."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Headless plotting: the default run happens on machines with no display.
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class MetricsLogger:
    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if resume:
            _end_partial_line(self.path)
        self._file = self.path.open("a" if resume else "w")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))

    def log(self, step: int, kind: str, values: dict[str, Any]) -> None:
        record = {"step": step, "kind": kind, **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                for name, scalar in (value.items() if isinstance(value, dict) else [(None, value)]):
                    if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
                        self._writer.add_scalar(f"{kind}/{key}" + (f"/{name}" if name else ""), scalar, step)

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()


def _end_partial_line(path: Path) -> None:
    """A killed run can leave its last record cut short; end that line so appended records start on
    their own line. The partial bytes stay (nothing on disk is dropped); readers skip them."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, 2)
        if f.read(1) != b"\n":
            f.write(b"\n")


def _parse(line: str) -> dict[str, Any] | None:
    """One record, or None for a line that is not one (a record cut short when a run was killed)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "step" in record and "kind" in record else None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; after a resume, a step logged twice keeps its latest record.
    Partial lines left by a killed run are skipped."""
    by_key: dict[tuple[int, str], dict[str, Any]] = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        record = _parse(line) if line.strip() else None
        if record is not None:
            by_key[(record["step"], record["kind"])] = record
    return sorted(by_key.values(), key=lambda r: (r["step"], r["kind"]))


def _ema(values: tuple[float, ...], decay: float) -> list[float]:
    out, avg = [], values[0]
    for v in values:
        avg = decay * avg + (1 - decay) * v
        out.append(avg)
    return out


# The validation split's reference figures (a "baselines" record), drawn beside the model's curve.
BASELINE_LINES = (
    ("unigram_bpb", "unigram entropy", ":"),
    ("xz_bpb", "xz -9e, split alone", "--"),
    ("xz_given_train_bpb", "xz -9e given train", "-."),
)


def baselines_of(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last "baselines" record of a run's metrics, or None (runs before issue 13 have none)."""
    found = [r for r in records if r["kind"] == "baselines"]
    return found[-1] if found else None


def _validation_label(record: dict[str, Any]) -> str:
    """What the validation points cover: the whole split the baselines cover, or a share of it."""
    tokens, split = record.get("val_tokens"), record.get("val_split_tokens")
    if tokens is None:  # a run from before the records said so
        return "validation"
    share = "whole split" if record.get("val_whole_split") else f"{tokens / max(split, 1):.0%} of the split"
    return f"validation ({tokens:,} tokens, {share})"


def plot_loss(metrics_path: str | Path, png_path: str | Path) -> Path:
    """Training loss, and validation bits-per-byte against step with the run's baselines as lines."""
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train" and "loss" in r]
    val_records = [r for r in records if r["kind"] == "val" and "val_bpb" in r]
    val = [(r["step"], r["val_bpb"]) for r in val_records]
    fig, (ax_loss, ax_bpb) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        steps, losses = zip(*train, strict=True)
        ax_loss.plot(steps, losses, lw=0.8, alpha=0.4, label="per logged step")
        # One batch's loss is a noisy estimate: show the trend too.
        ax_loss.plot(steps, _ema(losses, 0.9), lw=1.5, label="moving average")
        ax_loss.legend()
    ax_loss.set(xlabel="step", ylabel="train loss (nats/token)", title="training loss")
    if val:
        ax_bpb.plot(*zip(*val, strict=True), marker="o", label=_validation_label(val_records[-1]))
    baselines = baselines_of(records)
    for key, label, style in BASELINE_LINES if baselines else ():
        if key in baselines:
            ax_bpb.axhline(baselines[key], color="gray", ls=style, label=f"{label} {baselines[key]:.3f}")
    ax_bpb.set(xlabel="step", ylabel="bits per byte", title="validation bits per byte")
    if val or baselines:
        ax_bpb.legend()
    for ax in (ax_loss, ax_bpb):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
