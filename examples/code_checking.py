"""Code checking: check the syntax locally, review every function in parallel, then conclude.

    .venv/bin/python examples/code_checking.py [--url URL] [--limit N]
"""

from __future__ import annotations

import ast
from typing import Any

from justitia_sdk import agent, llm, parallel_map

REVIEW_PROMPT = ("Specification: {spec}\n\nReview this Python function for bugs and for "
                 "mismatches with the specification. List each problem on its own line, or "
                 "write OK.\n\n{source}\n\nReview:")
VERDICT_PROMPT = ("Specification: {spec}\nReviews of each function:\n{reviews}\n\n"
                  "Does the code meet the specification? Answer PASS or FAIL and say why.\n"
                  "Verdict:")


def functions_of(code: str) -> tuple[bool, str, list[tuple[str, str]]]:
    """(syntax ok, syntax error, [(function name, its source)]); the whole module if none."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return False, f"line {exc.lineno}: {exc.msg}", [("<module>", code)]
    funcs = [(n.name, ast.get_source_segment(code, n) or "") for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return True, "", funcs or [("<module>", code)]


@agent("code_checking")
async def code_checking(spec: str, code: str, max_tokens: int = 64) -> dict[str, Any]:
    syntax_ok, syntax_error, funcs = functions_of(code)
    reviews = await parallel_map(
        lambda source: llm(REVIEW_PROMPT.format(spec=spec, source=source),
                           max_tokens=max_tokens, temperature=0),
        [src for _, src in funcs],
    )
    listing = "\n".join(f"- {name}: {' '.join(r.split()[:40])}"
                        for (name, _), r in zip(funcs, reviews, strict=True))
    verdict = await llm(VERDICT_PROMPT.format(spec=spec, reviews=listing),
                        max_tokens=max_tokens, temperature=0)
    passed = syntax_ok and "FAIL" not in verdict.upper()
    return {"syntax_ok": syntax_ok, "syntax_error": syntax_error,
            "functions": [n for n, _ in funcs], "reviews": reviews, "verdict": verdict,
            "passed": passed}


if __name__ == "__main__":
    from _runner import inputs_path, main

    main(code_checking, inputs_path("code_checking"))
