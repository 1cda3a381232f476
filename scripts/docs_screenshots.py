"""Screenshots of the built documentation site, for reviewing how pages render (wide tables,
plots) without serving it: builds the site into a temporary directory and has headless
Chromium capture each page, from its anchor on, into ``results/docs/<name>.png``.

Needs ``chromium`` on the PATH (Debian: ``apt-get install chromium``); nothing else is
downloaded. The PNGs are reduced to 256 colours to keep the repository small.

Usage::

    .venv/bin/python scripts/docs_screenshots.py                 # the default pages
    .venv/bin/python scripts/docs_screenshots.py evidence/fidelity#the-run
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Pages whose rendering was fixed or changed (wide tables, redrawn plots), by site path and
# anchor; the home page as the site's face.
PAGES = (
    "",
    "evidence/fidelity#the-run",
    "evidence/fidelity#multi-turn-chats",
    "evidence/fidelity#2048-token-prompts",
    "evidence/accuracy#plots",
    "evidence/pressure",
    "user_guide/choosing",
    "contributing/per_head_memory#the-cpu-kernel-regrouped-measured",
    "user_guide/gpus#what-ran-where",
    "evidence/performance#four-long-requests-at-once-where-the-time-goes",
    "evidence/prefix_caching#before",
    "user_guide/prefix_caching",
)


def name_of(page: str) -> str:
    return (page.replace("/", "-").replace("#", "--").strip("-") or "home")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="*", default=list(PAGES), help="site path[#anchor]")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "docs")
    ap.add_argument("--size", default="1280,1600", help="window width,height in pixels")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("docs_screenshots: no chromium on the PATH (Debian: apt-get install chromium)")
    from PIL import Image

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q", "--config-file",
                        str(ROOT / "mkdocs.yml"), "-d", str(site)], check=True)  # fmt: skip
        for page in args.pages:
            path, _, anchor = page.partition("#")
            html = site / path / "index.html"
            if not html.exists():
                sys.exit(f"docs_screenshots: {html} was not built")
            if anchor:
                # Headless Chromium captures the top of the document whatever the scroll, so
                # a copy of the page drops what comes before the anchor's heading instead.
                trim = (f"<script>const t = document.getElementById({json.dumps(anchor)});"
                        "while (t && t.previousElementSibling) t.previousElementSibling.remove();"
                        "</script></body>")  # fmt: skip
                copy = html.with_name(f"index.{anchor}.html")
                copy.write_text(html.read_text().replace("</body>", trim, 1))
                html = copy
            url = html.as_uri()
            png = args.out / f"{name_of(page)}.png"
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                            "--hide-scrollbars", f"--window-size={args.size}",
                            f"--screenshot={png}", url],
                           check=True, capture_output=True, timeout=120)  # fmt: skip
            Image.open(png).convert("RGB").quantize(256).save(png, optimize=True)
            print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
