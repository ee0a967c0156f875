"""engine_bench.json as markdown: the figures with their roofline fractions, then agreement."""
from __future__ import annotations

from engine_templates.engine.bench import op_profile
from engine_templates.engine.bench.roofline import fraction

LABELS = {"decode_b1_tok_s": "decode, batch 1 (tok/s)", "ttft": "TTFT, {n} tokens (ms)",
          "concurrent": "output, {n} concurrent (tok/s)", "decode": "decode, batch 1, after {n} tokens (tok/s)"}


def _label(metric: str) -> str:
    if metric in LABELS:
        return LABELS[metric]
    kind, n = metric.split("_")[0], metric.split("_")[1]
    if kind == "decode":  # decode_b1_ctx<N>_tok_s
        n = metric.split("_ctx")[1].split("_")[0]
    return LABELS[kind].format(n=n)


def _metric_names(result: dict) -> list[str]:
    w = result["workload"]
    return (["decode_b1_tok_s"] + [f"decode_b1_ctx{n}_tok_s" for n in w.get("decode_contexts", ())]
            + [f"ttft_{n}_ms" for n in w["ttft_lengths"]] + [f"concurrent_{w['concurrency']}_tok_s"])


def _cell(system: dict, metric: str, roofline: float) -> str:
    """The figure and its fraction of the system's own roofline (an FP8 engine's reads half the
    bytes) — or "-" for a phase the system does not run (HF after a long prompt)."""
    if "error" in system:
        return "error"
    m = system["metrics"].get(metric)
    if m is None:
        return "-"
    roofline = system.get("roofline", {}).get(metric, roofline)
    capped = " (capped)" if m.get("capped") else ""
    own = " of its FP8 roofline" if "roofline" in system else ""
    return f"{m['value']:.4g} ({100 * fraction(metric, m['value'], roofline):.1f}%{own}){capped}"


SERVING_METRICS = ("output_tps", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms",
                   "output_tps_per_user_p50", "output_tps_per_user_p10")


def _serving_table(systems: dict) -> list[str]:
    """`--serving`: each pattern's figures per engine variant, named as serve-bench names them."""
    ran = [name for name, s in systems.items() if "serving" in s]
    if not ran:
        return []
    lines = ["", "| pattern (in process) | metric | " + " | ".join(ran) + " |", "|---|---|" + "---|" * len(ran)]
    for pattern in systems[ran[0]]["serving"]:
        for metric in SERVING_METRICS:
            cells = [systems[n]["serving"].get(pattern, {}).get(metric) for n in ran]
            lines.append(f"| {pattern} | {metric} | " + " | ".join("-" if c is None else f"{c:.4g}" for c in cells) + " |")
    return lines


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"


def markdown(result: dict) -> str:
    dev, ceil = result["device"], result["ceilings"]
    lines = [f"# Engine benchmark: {dev['name']} (torch {dev['torch']}, triton {dev['triton']}), "
             f"{result['dtype']}, random weights",
             "",
             f"Copy bandwidth {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul "
             f"{ceil['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s, measured in this run. Each figure is "
             "followed by its fraction of the weight-bytes roofline (rates: measured / roofline; "
             "times: roofline / measured). Decode bounds count the KV cache read at the phase's mean "
             "context. TTFT's matmul-FLOP bound is given beside its roofline.",
             ""]
    for preset, r in result["presets"].items():
        systems = list(r["systems"])
        lines += [f"## {preset}", "",
                  "| metric | bytes roofline | " + " | ".join(systems) + " |",
                  "|---|---|" + "---|" * len(systems)]
        for metric in _metric_names(result):
            bound = r["roofline"][metric]
            flops = r["roofline"].get(f"{metric}_flops")
            roof = f"{bound:.4g}" + (f" (FLOPs: {flops:.3g})" if flops is not None else "")
            cells = [_cell(r["systems"][s], metric, bound) for s in systems]
            lines.append(f"| {_label(metric)} | {roof} | " + " | ".join(cells) + " |")
        lines += ["", "| system | agreement | graphs | graphs = eager tokens | gap to HF argmax "
                      "| logprob diff vs HF | HF greedy equal prefix |", "|---|---|---|---|---|---|---|"]
        for name, s in r["systems"].items():
            if "error" in s:
                lines.append(f"| {name} | error: {s['error'][:200]} | | | | | |")
            elif "check" in s:
                c = s["check"]
                hf = c.get("engine_vs_hf", {})
                lines.append(
                    f"| {name} | {'ok' if c['agree'] else 'NOT OK'} | {c['graphs']} | "
                    f"{c['graphs_vs_eager']['tokens_equal']} | {hf.get('worst_gap_to_hf_argmax', float('nan')):.3g} | "
                    f"{hf.get('max_logprob_diff', float('nan')):.3g} | {hf.get('hf_greedy_equal_prefix', '')} |")
        if "chunk_sweep" in r:
            c = r["chunk_sweep"]
            lines += ["", f"Prefill chunk {c['chosen']} tokens, the smallest within {1 - c['within']:.0%} of the best "
                          "GEMM efficiency of one layer (% of the measured matmul rate): "
                      + ", ".join(f"{p['tokens']}: {p['efficiency']:.0%}" for p in c["points"]) + "."]
        lines += _serving_table(r["systems"])
        lines += op_profile.markdown({name: s["profile"] for name, s in r["systems"].items() if "profile" in s})
        spec = {name: s["speculative"] for name, s in r["systems"].items() if "speculative" in s}
        if spec:
            lines += ["", "| system | drafted tokens | accepted | acceptance rate |", "|---|---|---|---|"]
            lines += [f"| {name} | {x['drafted_tokens']} | {x['accepted_tokens']} | {_rate(x['acceptance_rate'])} |"
                      for name, x in spec.items()]
        lines.append("")
    return "\n".join(lines)
