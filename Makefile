# The two commands of the README. Both set up .venv first (idempotent: seconds when done).
.PHONY: setup demo test docs

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/justitia demo

test: setup
	.venv/bin/python -m pytest -q
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
