"""`npuspeed compare A B [--json] [--plot PNG] [--steps LIST] [--rtol X]`: the loss curves side by
side, then the first dumped step where the runs part and, there, the first module in forward order
and in backward order (and the first parameter or gradient) beyond the tolerance."""
from __future__ import annotations

import argparse
import json
import math

from npuspeed.compare import diverge, load
from npuspeed.errors import UserError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspeed compare", description=__doc__)
    p.add_argument("a", help="the first run's --npuspeed-dump folder (the reference)")
    p.add_argument("b", help="the second run's --npuspeed-dump folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", default="npuspeed_compare_loss.png", metavar="PNG",
                   help="where to draw the two loss curves (default %(default)s; needs matplotlib)")
    p.add_argument("--no-plot", action="store_true", help="draw no PNG")
    p.add_argument("--steps", default=None, metavar="LIST", help="only these dumped steps (e.g. 1,3-5)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance instead of the dtypes' "
                   "(float32 1e-4, float16 1e-2, bfloat16 5e-2)")
    return p


def _check_same_model(a: load.Dump, b: load.Dump) -> None:
    """One line naming the first parameter whose logical shape or presence differs."""
    def logical(dump):
        out = {}
        for layout in dump.layouts.values():
            for name, p in layout["parameters"].items():
                shape = list(p["shape"])
                if p["partition_dim"] is not None:
                    shape[p["partition_dim"]] *= layout["tp_size"]
                out.setdefault(name, shape)
        return out

    pa, pb = logical(a), logical(b)
    for name in sorted(set(pa) | set(pb)):
        if name not in pb or name not in pa:
            side, other = ("A", "B") if name in pa else ("B", "A")
            raise UserError(f"A and B are dumps of different models: parameter {name} is in {side}, not in {other}")
        if pa[name] != pb[name]:
            raise UserError(f"A and B are dumps of different models: parameter {name} is {pa[name]} in A and "
                            f"{pb[name]} in B")


def _steps(a: load.Dump, b: load.Dump, wanted: str | None) -> tuple[list[int], list[str]]:
    notes = []
    common = sorted(set(a.steps) & set(b.steps))
    if wanted:
        from npuspeed.features.dump.selection import parse_steps

        try:
            chosen = parse_steps(wanted)
        except Exception as exc:  # noqa: BLE001 - the dump flag's message, reworded for --steps
            raise UserError(f"--steps {wanted}: give dumped steps and ranges, e.g. --steps 1,3-5") from exc
        lacking = sorted(s for s in chosen if s not in common)
        if lacking:
            side = "A" if any(s not in a.steps for s in lacking) else "B"
            raise UserError(f"--steps {wanted}: step {lacking[0]} is not dumped in {side} (A has {a.steps}, "
                            f"B has {b.steps})")
        return sorted(chosen), notes
    if not common:
        raise UserError(f"A and B have no dumped step in common (A: {a.steps}, B: {b.steps}); dump the same "
                        "--dump-steps in both runs")
    only = sorted(set(a.steps) ^ set(b.steps))
    if only:
        notes.append(f"steps {only} are dumped in one run only and not compared")
    return common, notes


def _plot(path: str, rows: list[dict]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not importable here (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for side in ("a", "b"):
        pts = [(r["step"], r[side]) for r in rows if r[side] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=side.upper())
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(args) -> dict:
    a, b = load.load(args.a, "A"), load.load(args.b, "B")
    _check_same_model(a, b)
    steps, notes = _steps(a, b, args.steps)
    loss_tol = diverge.tolerance(a.first["params_dtype"], b.first["params_dtype"])
    rows = []
    for step in sorted(set(load.loss_steps(a)) | set(load.loss_steps(b))):
        la, lb = load.step_loss(a, step), load.step_loss(b, step)
        rel = abs(la - lb) / max(abs(la), abs(lb), 1e-30) if la is not None and lb is not None else None
        rows.append({"step": step, "a": la, "b": lb, "rel_diff": rel, "over": rel is not None and rel > loss_tol})
    result = {"a": a.path, "b": b.path, "losses": rows, "loss_tolerance": loss_tol, "steps_compared": [],
              "divergence": None, "notes": notes, "max_rel_error": 0.0,
              # parameter values beyond the tolerance at a step where nothing else is: not a divergence
              "parameter_drift": []}
    la_, lb_ = a.first, b.first
    same_data = (la_["dp_size"], la_["cp_size"]) == (lb_["dp_size"], lb_["cp_size"])
    if not same_data:
        notes.append(f"data-parallel x context-parallel sizes differ (A {la_['dp_size']}x{la_['cp_size']}, "
                     f"B {lb_['dp_size']}x{lb_['cp_size']}): module outputs and gradients see other batches and "
                     "are not compared; parameters and their (reduced) gradients are")
    result["plot"] = None if args.no_plot else _plot(args.plot, rows)
    for step in steps:
        done = diverge.compare_step(a, b, step, args.rtol)
        result["steps_compared"].append(step)
        found = {}
        for direction in ("forward", "backward", "parameter", "parameter_data"):
            if direction in ("forward", "backward") and not same_data:
                continue
            measured = [c.error for c in done[direction] if c.error is not None and direction != "parameter_data"]
            result["max_rel_error"] = max([result["max_rel_error"], *measured]) if measured else result["max_rel_error"]
            first, before = diverge.first_over(done[direction])
            if first is not None:
                found[direction] = {**first.as_dict(), "before": [c.as_dict() for c in before]}
        if done["skipped"]:
            notes.append(f"step {step}: {len(done['skipped'])} slot(s) in A only, e.g. {done['skipped'][0]}")
        drift = found.pop("parameter_data", None)
        if found:
            result["divergence"] = {"step": step, **{d: found.get(d) for d in ("forward", "backward", "parameter")},
                                    "parameter_data": drift}
            break
        if drift is not None:
            result["parameter_drift"].append({"step": step, **drift})
    return result


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.6g}"
    return str(x)


def _slot(c: dict) -> str:
    where = c["slot"] if c["direction"] != "backward" else f"{c['slot']}[{c['position']}]"
    if c["direction"] == "forward":
        where = f"output[{c['position']}]"
    s = c["a"] or {}
    t = c["b"] or {}
    return (f"{c['module']} ({c['class']}) {where} micro-batch {c['micro_batch']}: rel. error {_fmt(c['rel_error'])} "
            f"(tolerance {_fmt(c['tolerance'])}; {c['note']})\n"
            f"      A {s.get('dtype')} {s.get('shape')} min {_fmt(s.get('Min'))} max {_fmt(s.get('Max'))} "
            f"mean {_fmt(s.get('Mean'))} norm {_fmt(s.get('Norm'))} nan {s.get('NaN')} inf {s.get('Inf')}\n"
            f"      B {t.get('dtype')} {t.get('shape')} min {_fmt(t.get('Min'))} max {_fmt(t.get('Max'))} "
            f"mean {_fmt(t.get('Mean'))} norm {_fmt(t.get('Norm'))} nan {t.get('NaN')} inf {t.get('Inf')}")


def render(result: dict) -> str:
    lines = [f"A: {result['a']}", f"B: {result['b']}", "",
             f"{'iteration':>9}  {'loss A':>14}  {'loss B':>14}  {'rel. diff':>10}"]
    for r in result["losses"]:
        mark = "  <- beyond tolerance" if r["over"] else ""
        lines.append(f"{r['step']:>9}  {_fmt(r['a']):>14}  {_fmt(r['b']):>14}  {_fmt(r['rel_diff']):>10}{mark}")
    lines.append(f"plot: {result['plot'] or 'not drawn (--no-plot)'}")
    lines += [f"note: {n}" for n in result["notes"]]
    div = result["divergence"]
    for d in result["parameter_drift"]:
        lines.append(f"note: step {d['step']}: parameter values differ beyond the tolerance while every activation "
                     f"and gradient agrees (an optimizer step on rounding noise): first {_slot(d)}")
    if div is None:
        lines.append(f"no divergence: dumped steps {result['steps_compared']} agree within the tolerance "
                     f"(largest relative error {_fmt(result['max_rel_error'])})")
        return "\n".join(lines)
    lines.append(f"the runs part at step {div['step']}")
    for direction, title in (("forward", "first in forward order"), ("backward", "first in backward order"),
                             ("parameter", "first parameter gradient"),
                             ("parameter_data", "first parameter value")):
        c = div.get(direction)
        if c is None:
            lines.append(f"  {title}: none beyond tolerance")
            continue
        lines.append(f"  {title}: {_slot(c)}")
        for b in c["before"]:
            lines.append(f"    before it: {_slot(b)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from npuspeed.errors import exit_on_user_error

    args = parser().parse_args(argv)
    with exit_on_user_error():
        result = run(args)
    print(json.dumps(result, indent=2, default=str) if args.json else render(result))
    return 0
