# The two commands of the README. Both set up .venv first (idempotent: seconds when done).
.PHONY: setup browser demo test test-fast check docs results

setup:
	@bash scripts/setup.sh

# Debian's chromium, for the dashboard's browser tests (part of `test`).
browser:
	@bash scripts/browser.sh

demo: setup
	.venv/bin/justitia demo

# Every test: all that needs no engine (the fast tier and the slow tests) on every core, then
# the engine tier in one process (one vLLM engine at a time).
test: setup browser
	.venv/bin/python -m pytest -q -m "not engine" -n auto
	.venv/bin/python -m pytest -q -m engine
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet

# The tests that need no engine and are not slow (docs/architecture.md, Testing); `test` runs them too.
test-fast: setup
	.venv/bin/python -m pytest -q -m "not engine and not slow" -n auto

# Lint, types and import contracts (docs/architecture.md, Testing); CI runs it before `test`.
check: setup
	.venv/bin/ruff check .
	.venv/bin/mypy
	.venv/bin/lint-imports
	.venv/bin/python benchmarks/results_page.py --check

# docs/results.md and the README's results table, from the curated files in benchmarks/results/.
results: setup
	.venv/bin/python benchmarks/results_page.py
