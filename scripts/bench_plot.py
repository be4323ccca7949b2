"""Draws the benchmark's plot from its report.json (examples/bench.rs writes both):
   python scripts/bench_plot.py REPORT.json OUT.png
Four panels, each run of each variant (format and precision) a dot and its median a bar: the 1000-photo request
(images/s, with the naive one-batch pipeline as a line), single-image req/s at concurrency
1, 8 and 32, the cores the server kept busy during the 1000-photo request, and the server's
peak RSS (with the 600 MiB target as a line)."""

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {
    "torchscript fp32": "#4C72B0",
    "torchscript bf16": "#DD8452",
    "onnx fp32": "#55A868",
    "openvino fp32": "#C44E52",
    "openvino bf16": "#8172B2",
    "pt2 fp32": "#937860",
}


def per_variant(runs, value):
    out = {}
    for run in runs:
        out.setdefault(run["variant"], []).append(value(run))
    return out


def bars(ax, groups, title, unit, line=None, line_label=None):
    names = list(groups)
    for i, name in enumerate(names):
        values = groups[name]
        colour = COLOURS.get(name.split(" c=")[0], "#888888")
        median = statistics.median(values)
        ax.bar(i, median, color=colour, alpha=0.7)
        ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
        ax.annotate(f"{median:.3g}", (i, median), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    if line is not None:
        ax.axhline(line, color="grey", ls="--", lw=1)
        ax.annotate(line_label, (-0.4, line), ha="left", va="bottom", fontsize=8, color="grey")
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=25, ha="right")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit, fontsize=8)


def main():
    report = json.load(open(sys.argv[1]))
    runs = report["runs"]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 2.2, 1, 1]})
    bars(axes[0], per_variant(runs, lambda r: r["request_images_per_s"]),
         f"one /predict of {report['images']} photos", "images/s",
         report["naive"]["images_per_s"], "naive one batch")
    single = {}
    for load in sorted({load["concurrency"] for run in runs for load in run["single"]}):
        for run in runs:
            for one in run["single"]:
                if one["concurrency"] == load:
                    single.setdefault(f"{run['variant']} c={load}", []).append(one["req_per_s"])
    bars(axes[1], single, "single-image requests", "req/s")
    bars(axes[2], per_variant(runs, lambda r: r["cores_busy"]),
         f"cores busy (of {report['cores']}) during the request", "CPU s / wall s", report["cores"], "all cores")
    bars(axes[3], per_variant(runs, lambda r: r["peak_rss_mib"]), "server peak RSS", "MiB", 600, "600 MiB")
    fig.suptitle(f"visiongate on {report['cores']} cores, each dot one run ({report['photos']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
