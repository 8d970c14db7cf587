"""Command line: ``python -m gtpo.viz tokens ...`` and ``python -m gtpo.viz curves ...``.

Examples::

    python -m gtpo.viz tokens --input outputs/rollouts/tokens_20.jsonl --out viz/ --color advantage
    python -m gtpo.viz tokens --input outputs/rollouts --out viz/ --color entropy --max-prompts 4
    python -m gtpo.viz tokens --input outputs/rollouts/20.jsonl --out viz/ --color score --tokenizer /models/qwen
    python -m gtpo.viz curves --run grpo=logs/grpo.jsonl --run gtpo=logs/gtpo.jsonl --out curves.png
"""

from __future__ import annotations

import argparse
import sys

from gtpo.viz.curves import parse_run_spec, plot_curves
from gtpo.viz.tokens import COLOR_MODES, render_tokens


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s}: must be >= 1")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gtpo.viz", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tokens", help="token heatmap (HTML + PNG) of sampled responses")
    t.add_argument("--input", required=True, help="tokens_<step>.jsonl, verl's <step>.jsonl, or a rollout_data_dir")
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--color", choices=COLOR_MODES, default="advantage", help="what colours each token")
    t.add_argument("--tokenizer", default=None, help="local tokenizer folder: splits verl's text dumps into tokens")
    t.add_argument("--max-prompts", type=_positive_int, default=16, help="prompt groups to render (default 16)")
    t.add_argument("--step", type=int, default=None, help="with a folder --input: this step (default: latest)")
    t.add_argument("--vmax", type=float, default=None, help="fix the colour scale (default: max over the page)")
    t.add_argument(
        "--correct-threshold",
        type=float,
        default=0.0,
        help="without 'acc', a response is correct when score > this (default 0)",
    )
    t.add_argument("--no-png", action="store_true", help="write only the HTML")
    t.add_argument(
        "--png-max-tokens",
        type=_positive_int,
        default=240,
        help="longer responses are drawn in compact mode in the PNG: an overview and their most / least credited "
        "spans (default 240)",
    )
    t.add_argument("--span-tokens", type=_positive_int, default=24, help="tokens per span in compact mode (default 24)")

    c = sub.add_parser("curves", help="training curves of one or more runs (PNG)")
    c.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a run's metrics JSONL (verl file logger or plain {step, key: value}); repeat to overlay runs, "
        "repeat a NAME for seeds of one method (drawn as mean and min-max band)",
    )
    c.add_argument("--out", required=True, help="output PNG")
    c.add_argument(
        "--metrics",
        nargs="+",
        default=None,
        help="metric keys or fnmatch patterns, one panel each (default: mean reward, policy entropy, response "
        "length, validation Mean@N)",
    )
    c.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) for the drawn lines")
    c.add_argument("--title", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "tokens":
            res = render_tokens(
                args.input,
                args.out,
                color=args.color,
                tokenizer=args.tokenizer,
                max_prompts=args.max_prompts,
                step=args.step,
                vmax=args.vmax,
                correct_threshold=args.correct_threshold,
                png=not args.no_png,
                png_max_tokens=args.png_max_tokens,
                span_tokens=args.span_tokens,
            )
            print(f"{res['input']}: {res['n_prompts']} prompts, {res['n_responses']} responses")
            print(f"wrote {res['html']}" + (f" and {res['png']}" if res["png"] else ""))
        else:
            runs = [parse_run_spec(s) for s in args.run]
            series = plot_curves(runs, args.out, metrics=args.metrics, smooth=args.smooth, title=args.title)
            for name, keys in series.items():
                print(f"{name}: {', '.join(f'{k} ({len(v[0])} points)' for k, v in keys.items())}")
            print(f"wrote {args.out}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
