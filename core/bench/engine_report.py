"""The engine report: the issue's targets against a run, and its markdown.

A report may hold some parts only (``quality``, ``quality-reordered``, ``speed``): what
was not measured is said so, never filled in.
"""

from __future__ import annotations

from typing import Any

from chunkcache.core.bench.report import tail_label

# DESIGN, facts checked: a plain CacheBlend loop over SmolLM2, float32, 40 prompts.
PLAIN_LOOP = {
    "reuse": (0.086, 0.895),
    "cacheblend-0.15": (0.054, 0.912),
    "cacheblend-0.30": (0.030, 0.934),
}
Target = tuple[str, float, str, float, str]  # label, measured, comparison, bound, unit


def quality_targets(quality: Any, scenario: str = "") -> list[Target]:
    """The issue's quality targets (means over prompts); ``scenario`` labels a warm-up other
    than CacheBlend's, where only cachecraft's targets apply."""
    q = {name: {m: v["mean"] for m, v in row.items()} for name, row in quality["summary"].items()}
    cb15, cb30, craft = q["cacheblend-0.15"], q["cacheblend-0.30"], q["cachecraft"]
    blend: list[Target] = [
        ("cacheblend-0.15 TF KL <= 0.054", cb15["tf_kl"], "<=", 0.054, ""),
        ("cacheblend-0.15 TF top-1 >= 0.912", cb15["tf_top1"], ">=", 0.912, ""),
    ]
    craft_targets: list[Target] = [
        (
            "cachecraft token-layers <= cacheblend-0.15's",
            craft["token_layer_share"],
            "<=",
            cb15["token_layer_share"],
            "",
        ),
        ("cachecraft TF KL <= cacheblend-0.30's", craft["tf_kl"], "<=", cb30["tf_kl"], ""),
        ("cachecraft TF top-1 >= cacheblend-0.30's", craft["tf_top1"], ">=", cb30["tf_top1"], ""),
    ]
    if not scenario:
        return blend + craft_targets
    return [(f"{label} ({scenario})", m, op, b, unit) for label, m, op, b, unit in craft_targets]


def speed_targets(speed: Any) -> list[Target]:
    """The issue's speed targets (medians over prompts)."""
    cb15 = speed["summary"]["cacheblend-0.15"]
    hf = speed["summary"]["hf generate"]
    return [
        (
            "cacheblend-0.15 TTFT <= 0.2 x full (median of per-prompt ratios)",
            cb15["ratio_to_full"]["median"],
            "<=",
            0.2,
            "",
        ),
        (
            "cacheblend-0.15 TTFT < HF generate (medians)",
            cb15["ms"]["median"],
            "<",
            hf["ms"]["median"],
            "ms",
        ),
    ]


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of every measured part next to what the run measured."""
    rows = []
    if "quality" in report:
        rows += quality_targets(report["quality"])
    if "quality-reordered" in report:
        rows += quality_targets(report["quality-reordered"], "chunks cached reordered")
    if "speed" in report:
        rows += speed_targets(report["speed"])
    compare = {"<=": float.__le__, ">=": float.__ge__, "<": float.__lt__}
    return [
        {"target": label, "measured": m, "bound": b, "unit": unit, "met": compare[op](m, b)}
        for label, m, op, b, unit in rows
    ]


MEASURED_PARTS = ("quality", "quality-reordered", "speed")


def _machine(env: dict[str, str]) -> str:
    """The CPU and versions a part ran on."""
    return (
        f"{env['cpu']} ({env['cores']} cores), Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}"
    )


def header(report: dict[str, Any]) -> list[str]:
    names = [name for name in MEASURED_PARTS if name in report]
    machines = {name: _machine(report[name]["environment"]) for name in names}
    one_machine = len(set(machines.values())) == 1
    measured = "; ".join(
        f"{name} by `{report[name].get('command', report['command'])}`"
        + ("" if one_machine else f" on {machines[name]}")
        + f" at commit {report[name]['environment']['commit']} with "
        f"{report[name]['environment']['torch_threads']} torch threads (model fingerprint "
        f"`{report[name]['fingerprint']}`)"
        for name in names
    )
    where = f"On {machines[names[0]]}, " if one_machine else "Parts on different machines: "
    return [
        "# Engine benchmark: recompute policies against a full prefill",
        "",
        f"{where}chunkcache {report[names[-1]]['environment']['chunkcache']}; model "
        f"{report['model']}, seed {report['seed']}. Measured: {measured}.",
        "",
        f"{report['prompts']} RAG prompts over the bundled corpus: a fixed system message, "
        f"{report['chunks_per_prompt']} chunks picked by FAISS (MiniLM) for a templated question "
        f"on one or two of them, in shuffled order, chat template applied; "
        f"{report['prompt_tokens']['median']:.0f} tokens (median, "
        f"{report['prompt_tokens']['mean']:.0f} mean). Per prompt, a fresh in-memory store is "
        "warmed (by `full`, and by `cachecraft` for cachecraft, so its variants carry their CFO "
        "metadata) and each policy then reads it (its own new variants dropped). Two warm-ups:",
        "",
        "- after the system prefix (`quality`, `speed`): every chunk prefilled right after the "
        "system prefix on its own, CacheBlend's set-up; the system prefix is the only exact "
        "hit and all chunks are moved and (selectively) recomputed;",
        "- reordered (`quality-reordered`): as above, and then one earlier request held the "
        "same chunks in another order (seeded per prompt), as when another question retrieves "
        "the same top-k, so every chunk has two variants; the policies that take the most "
        "recent variant place the earlier request's, `cachecraft` the one of lowest CFO "
        "(Cache-Craft §3.3); only its chunk variants are kept, so the system prefix is again "
        "the only exact hit.",
    ]


QUALITY_TITLES = {
    "quality": "Quality",
    "quality-reordered": "Quality, chunks also cached by an earlier request in another order",
}


def quality_section(report: dict[str, Any], part: str = "quality") -> list[str]:
    quality = report[part]
    lines = [
        "",
        f"## {QUALITY_TITLES[part]} (float32, vs full; mean (median) over "
        f"{report['prompts']} prompts)",
        "",
        f"TF = teacher-forced along full's {quality['answer_tokens']}-token greedy answer; "
        "ROUGE-L F1 of the policy's own greedy answer vs full's (words). Token-layers: the "
        "share of prompt tokens x layers computed.",
        "",
        "| policy | 1st-token KL | 1st-token top-1 | TF KL | TF top-1 | ROUGE-L | "
        "token-layers | reused / recomputed / computed tokens |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in quality["summary"].items():

        def cell(metric: str, row: Any = row) -> str:
            return f"{row[metric]['mean']:.3f} ({row[metric]['median']:.3f})"

        counts = " / ".join(
            f"{row[m]['mean']:.0f}"
            for m in ("reused_tokens", "recomputed_tokens", "computed_tokens")
        )
        lines.append(
            f"| {name} | {cell('first_kl')} | {cell('first_top1')} | {cell('tf_kl')} | "
            f"{cell('tf_top1')} | {cell('rouge_l')} | {row['token_layer_share']['mean']:.1%} | "
            f"{counts} |"
        )
    lines += ["", "Teacher-forced KL lower, per prompt:", ""]
    lines += [f"- {pair}: {share:.0%} of prompts" for pair, share in quality["tf_kl_wins"].items()]
    if part != "quality":
        return lines
    plain = "; ".join(f"{name} {kl:.3f} / {top1:.3f}" for name, (kl, top1) in PLAIN_LOOP.items())
    return [
        *lines,
        "",
        f"DESIGN's plain CacheBlend loop (40 prompts, ~1,350 tokens), TF KL / top-1: {plain}.",
    ]


def speed_section(report: dict[str, Any]) -> list[str]:
    speed = report["speed"]
    cpu = speed["cpu"]
    tail = tail_label([report["prompts"]])  # each policy's figures: one best per prompt
    lines = [
        "",
        f"## Time to first token (bfloat16, {report['prompts']} prompts, best of "
        f"{speed['rounds']} interleaved rounds per prompt)",
        "",
        "prefill: `ChunkEngine.prefill` alone. e2e: `LocalBackend.stream` to the first token "
        "(tokenizing, prefill, sampling). HF: transformers on the same token ids, `generate("
        "max_new_tokens=1)` and a forward with `logits_to_keep=1`. x full: median over prompts "
        "of the per-prompt ratio to full (e2e to full e2e).",
        "",
        f"CPU while timing: this benchmark {cpu['own_cores']:.2f} cores, other processes "
        f"{cpu['other_cores']:.2f} cores"
        + (" (other work was running: timings are noisy)." if cpu["other_cores"] > 0.2 else "."),
        "",
        f"| policy | prefill p50 ms | prefill {tail} ms | x full | e2e p50 ms | e2e {tail} ms "
        "| e2e x full |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    s = speed["summary"]
    for name in [*(run["name"] for run in report["runs"]), "hf generate", "hf forward"]:
        row, e2e = s[name], s.get(f"{name} e2e")
        tail = (
            f"{e2e['ms']['median']:.0f} | {e2e['ms']['p99']:.0f} | "
            f"{e2e['ratio_to_full']['median']:.2f}"
            if e2e
            else "- | - | -"
        )
        lines.append(
            f"| {name} | {row['ms']['median']:.0f} | {row['ms']['p99']:.0f} | "
            f"{row['ratio_to_full']['median']:.2f} | {tail} |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: set-up, each measured part, and the targets."""
    lines = header(report)
    for part in MEASURED_PARTS:
        if part not in report:
            lines += ["", f"## {QUALITY_TITLES.get(part, part.title())}: not measured"]
        elif part == "speed":
            lines += speed_section(report)
        else:
            lines += quality_section(report, part)
    lines += ["", "## Targets (from the issue)", "", "| target | measured | bound | met |"]
    lines.append("| --- | ---: | ---: | --- |")
    for t in report["targets"]:
        value = "{:.0f} ms" if t["unit"] == "ms" else "{:.3f}"
        met = "yes" if t["met"] else "**no**"
        measured, bound = value.format(t["measured"]), value.format(t["bound"])
        lines.append(f"| {t['target']} | {measured} | {bound} | {met} |")
    return "\n".join(lines) + "\n"
