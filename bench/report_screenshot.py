"""Open a `batchrun report` page in headless Chromium, fail on any console error, page error or
plot that did not render, and save a full-page screenshot.

    python bench/report_screenshot.py REPORT.html SHOT.png [--chromium PATH]

Needs playwright (in batchrun's test extra) and a Chromium: --chromium, else $BATCHRUN_CHROMIUM,
else `chromium` or `google-chrome` on the PATH (Debian: apt-get install chromium), else
playwright's own (`python -m playwright install chromium`), else it exits 2. The page gets no
network: every request other than the file itself is refused and reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from batchrun.reporting.report import TITLES


def find_chromium() -> str | None:
    """A Chromium on this machine, or None."""
    found = os.environ.get("BATCHRUN_CHROMIUM")
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = found or shutil.which(name)
    if found is None:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            own = playwright.chromium.executable_path  # where `playwright install` puts it
        found = own if Path(own).exists() else None
    return found


def _console(problems: list[str], kind: str, text: str) -> None:
    if kind in ("error", "warning"):
        problems.append(f"console {kind}: {text}")


def check(report: Path, screenshot: Path, chromium: str) -> list[str]:
    """Problems seen while loading the report; saves the screenshot."""
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("console", lambda m: _console(problems, m.type, m.text))
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

        def only_the_file(route):  # type: ignore[no-untyped-def]
            if route.request.url == report.resolve().as_uri():
                route.continue_()
            else:
                problems.append(f"network request: {route.request.url}")
                route.abort()

        page.route("**/*", only_the_file)
        page.goto(report.resolve().as_uri(), wait_until="load")
        present = [i for i in TITLES if page.locator(f"#{i}").count()]
        page.wait_for_function(
            "ids => ids.every(i => document.querySelector(`#${i} .main-svg`))", arg=present
        )
        problems += [
            f"plot #{i} drew nothing" for i in present if not page.locator(f"#{i} g.trace").count()
        ]
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("screenshot", type=Path)
    parser.add_argument("--chromium", default=None)
    args = parser.parse_args()
    chromium = args.chromium or find_chromium()
    if chromium is None:
        print("no Chromium found; see this script's docstring", file=sys.stderr)
        return 2
    problems = check(args.report, args.screenshot, chromium)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
