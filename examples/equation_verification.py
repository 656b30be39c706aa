"""Equation verification: check each step of a worked solution, in parallel, two ways.

Each step "lhs = rhs" is evaluated exactly when both sides are plain arithmetic (a small
safe evaluator, no eval()), and is also sent to the model with the problem for a judgement.
A final request writes the verdict.

    .venv/bin/python examples/equation_verification.py [--url URL] [--limit N]
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from justitia_sdk import agent, llm, parallel_map

STEP_PROMPT = ("Problem: {problem}\nStep: {step}\n\nIs this step mathematically correct? "
               "Answer CORRECT or WRONG and give the corrected step if wrong.\nAnswer:")
SUMMARY_PROMPT = ("Problem: {problem}\nStep checks:\n{checks}\n\nSummarize whether the "
                  "solution is correct.\nSummary:")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 64):
            raise ValueError("exponent out of range")
        return Fraction(_OPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return Fraction(_OPS[type(node.op)](_eval(node.operand)))
    raise ValueError("not plain arithmetic")


def arithmetic_holds(step: str) -> bool | None:
    """True/False when every side of 'a = b = c' is plain arithmetic, else None."""
    sides = [s.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
             for s in step.split("=")]
    if len(sides) < 2:
        return None
    try:
        values = [_eval(ast.parse(s, mode="eval").body) for s in sides]
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None
    return all(v == values[0] for v in values[1:])


@agent("equation_verification")
async def equation_verification(problem: str, steps: list[str],
                                max_tokens: int = 48) -> dict[str, Any]:
    judgements = await parallel_map(
        lambda step: llm(STEP_PROMPT.format(problem=problem, step=step), max_tokens=max_tokens,
                         temperature=0),
        steps,
    )
    exact = [arithmetic_holds(s) for s in steps]
    checks = "\n".join(
        f"- {s} | exact: {'n/a' if e is None else e} | model: {' '.join(j.split()[:20])}"
        for s, e, j in zip(steps, exact, judgements, strict=True))
    summary = await llm(SUMMARY_PROMPT.format(problem=problem, checks=checks),
                        max_tokens=2 * max_tokens, temperature=0)
    return {"steps": [{"step": s, "arithmetic_ok": e, "model": j}
                      for s, e, j in zip(steps, exact, judgements, strict=True)],
            "all_arithmetic_ok": all(e is not False for e in exact), "summary": summary}


if __name__ == "__main__":
    from _runner import inputs_path, main

    main(equation_verification, inputs_path("equation_verification"))
