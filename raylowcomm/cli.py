"""raylowcomm run | tune | bench | report | assets."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raylowcomm import assets
from raylowcomm.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raylowcomm", description="Low-communication fine-tuning on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run the strategies of a config and compare them")
    run_p.add_argument("config")
    run_p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set optim.lr=0.01 (repeatable)")
    run_p.add_argument("--out", help="output directory (default: the config's out_dir)")
    tune_p = sub.add_parser("tune", help="sweep config fields with Ray Tune (a sweep file: see tune_configs/)")
    tune_p.add_argument("sweep")
    tune_p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the sweep's base config for every trial (repeatable)")
    tune_p.add_argument("--storage-path", help="where Tune writes the sweep (default: the sweep file's storage_path)")
    bench_p = sub.add_parser("bench", help="every strategy of a config on identical inputs, curves and a report: "
                                           "over a shaped 2-host link (wan, needs root) or on local Ray")
    bench_p.add_argument("mode", choices=["wan", "local"])
    bench_p.add_argument("config")
    bench_p.add_argument("--rate", dest="rates", action="append", default=[], metavar="RATE",
                         help="wan: link rate, e.g. 100mbit or 1gbit (repeatable; default 100mbit)")
    bench_p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config field (repeatable)")
    bench_p.add_argument("--out", help="output directory (default: the config's out_dir)")
    report_p = sub.add_parser("report", help="rebuild report.md and the curve plots of a bench (or run) directory from its saved results")
    report_p.add_argument("dir")
    report_p.add_argument("--target-fraction", type=float, default=0.95,
                          help="target = this fraction of DDP's final accuracy (for a loss: DDP's final / it)")
    assets_p = sub.add_parser("assets", help="list or fetch the bundled pretrained models and datasets")
    assets_p.add_argument("action", choices=["list", "fetch"])
    assets_p.add_argument("names", nargs="*", help="assets to fetch (default: all)")
    args = parser.parse_args(argv)

    if args.command == "assets":
        for name in args.names or list(assets.ASSETS):
            if name not in assets.ASSETS:
                print(f"error: unknown asset {name!r}; known: {', '.join(assets.ASSETS)}", file=sys.stderr)
                return 2
            a = assets.ASSETS[name]
            if args.action == "fetch":
                try:
                    print(f"{name}: {assets.fetch(name)}")
                except assets.AssetError as err:
                    print(f"error: {err}", file=sys.stderr)
                    return 1
            else:
                print(f"{name:20s} {a.kind:5s} {'cached' if a.ready() else 'not cached':10s} {a.about}")
        return 0

    if args.command == "bench":
        from raylowcomm.bench import bench_local, bench_wan, check_wan_prerequisites
        from raylowcomm.cluster import ClusterError

        try:
            cfg = load_config(args.config, args.overrides)
            out = Path(args.out or cfg.out_dir)
            if args.mode == "wan":
                check_wan_prerequisites()
                meta = bench_wan(cfg, args.rates or ["100mbit"], out)
            else:
                if args.rates:
                    raise ConfigError("--rate", args.rates, "only `bench wan` shapes a link; drop --rate for `bench local`")
                meta = bench_local(cfg, out)
        except (ConfigError, assets.AssetError, PermissionError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except ClusterError as err:
            print(f"error: the cluster failed (it has been torn down): {err}", file=sys.stderr)
            return 1
        failed = [r["label"] for r in meta["runs"] if r["returncode"] != 0]
        if failed:
            print(f"error: the run failed at {', '.join(failed)}: see its output above and results.json", file=sys.stderr)
        return 1 if failed else 0

    if args.command == "report":
        from raylowcomm.report import ReportError, write_report

        try:
            path = write_report(args.dir, args.target_fraction)
        except (ReportError, OSError, ValueError, KeyError) as err:
            print(f"error: cannot build a report from {args.dir}: {err}", file=sys.stderr)
            return 2
        print(path.read_text())
        print(f"report: {path}")
        return 0

    if args.command == "tune":
        from raylowcomm.tune import SweepError, load_sweep, run_sweep

        try:
            summary = run_sweep(load_sweep(args.sweep, args.overrides), args.storage_path)
        except (SweepError, assets.AssetError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 1 if any(t["status"] == "error" for t in summary["trials"]) else 0

    try:
        cfg = load_config(args.config, args.overrides)
        if args.out:
            cfg.out_dir = args.out
        from raylowcomm.run import run

        records = run(cfg)
    except (ConfigError, assets.AssetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
