"""``Metric.plot``: matplotlib figures of results (optional dependency).

A list of results is drawn over steps (one line per scalar, per class of a
vector result, or per member of a group's dict); a single 2-d result (a
confusion matrix) as an annotated heat map; a single scalar or vector as
points / bars. Returns ``(fig, ax)`` like torchmetrics' ``plot``.
"""

from __future__ import annotations

import torch

__all__ = ["plot_values"]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # optional dependency
        raise ImportError("Metric.plot() needs matplotlib: pip install matplotlib") from e
    return plt


def _host(v):
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", torch.float64)
    return torch.as_tensor(v, dtype=torch.float64)


def _series(values) -> dict[str, list]:
    """{label: [value per step]} of a list of results (tensors or dicts)."""
    out: dict[str, list] = {}
    for step in values:
        items = step.items() if isinstance(step, dict) else [(None, step)]
        for name, v in items:
            t = _host(v).reshape(-1)
            for i, x in enumerate(t.tolist()):
                label = name if t.numel() == 1 else f"{name}[{i}]" if name is not None else f"[{i}]"
                out.setdefault(label, []).append(x)
    return out


def plot_values(values, ax=None, title: str | None = None):
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots()
    else:
        fig = ax.get_figure()
    if isinstance(values, (list, tuple)):
        for label, ys in _series(values).items():
            ax.plot(range(len(ys)), ys, marker="o", markersize=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("value")
        if any(label is not None for label in _series(values)):
            ax.legend()
    elif isinstance(values, dict):
        names = list(values)
        ys = [_host(values[n]).reshape(-1)[0].item() if _host(values[n]).numel() == 1 else float("nan") for n in names]
        ax.bar(range(len(names)), ys)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    else:
        t = _host(values)
        if t.dim() == 2:
            im = ax.imshow(t.numpy(), cmap="Blues")
            fig.colorbar(im, ax=ax)
            ax.set_xlabel("predicted class")
            ax.set_ylabel("true class")
            if t.numel() <= 400:
                for (i, j), x in zip(((i, j) for i in range(t.shape[0]) for j in range(t.shape[1])), t.reshape(-1).tolist()):
                    ax.text(j, i, f"{x:.3g}", ha="center", va="center", fontsize=8)
        elif t.dim() == 1:
            ax.bar(range(t.numel()), t.tolist())
            ax.set_xlabel("class")
        else:
            ax.plot([0], [t.item()], marker="o")
    if title:
        ax.set_title(title)
    return fig, ax
