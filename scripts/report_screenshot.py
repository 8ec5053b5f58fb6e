"""The README's picture of the run report: build the report of RUN_URI and screenshot it in
Debian's headless chromium (through playwright).

    PYTHONPATH=. .venv/bin/python scripts/report_screenshot.py runs/default docs/img/report.png

The shot is the page's top (`--height` CSS pixels: the verdict, the summary, learning and the
role timeline), at 1100 px wide.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_core.report.html import build_report, page  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_uri")
    parser.add_argument("out")
    parser.add_argument("--height", type=int, default=1500)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "report.html"
        html.write_text(page(build_report(args.run_uri)), encoding="utf-8")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            tab = browser.new_page(viewport={"width": 1100, "height": args.height})
            tab.goto(html.as_uri(), wait_until="networkidle")
            tab.screenshot(path=args.out)
            browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
