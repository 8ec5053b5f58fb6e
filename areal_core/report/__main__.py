"""python -m areal_core.report RUN_URI [-o report.html]: the run's report as one HTML file (a
local path or s3://...; a past, crashed or running run). Prints the verdict and the file written;
a root that holds no run is a one-line error (exit status 2)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from areal_core.report.data import NotARun, load_run
from areal_core.report.doctor import diagnose
from areal_core.report.html import page, render
from areal_core.store import Store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_core.report", description=__doc__.split("\n")[0])
    parser.add_argument("run_uri", help="the run root: a local folder or s3://bucket/prefix")
    parser.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default report.html)")
    args = parser.parse_args(argv)
    try:
        data = load_run(Store(args.run_uri))
    except NotARun as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - an unreachable store or bad URI: one line, not a trace
        print(f"error: cannot read {args.run_uri}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(render(data)), encoding="utf-8")
    print(diagnose(data.records, data.rows)[0].line())
    print(f"report written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
