#!/usr/bin/env bash
# Refreshes docs/assets/dashboard.png: the browser test's picture of the live web dashboard.
#
# It runs tests/test_web.py's browser test (a real `traceml run --mode dashboard --deep` run,
# driven by Debian's Chromium at /usr/bin/chromium through Playwright) with
# TRACEML_DOCS_SCREENSHOT pointing at the docs' asset; the test fails on a blank page.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
  echo "docs_screenshot: Debian's chromium is needed at /usr/bin/chromium (apt-get install chromium)" >&2
  exit 1
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TRACEML_DOCS_SCREENSHOT="$PWD/docs/assets/dashboard.png"
export TRACEML_REQUIRE_BROWSER=1
python -m pytest -q -p no:cacheprovider tests/test_web.py -k test_browser_renders_the_live_page_mid_run
echo "docs_screenshot: wrote $TRACEML_DOCS_SCREENSHOT"
