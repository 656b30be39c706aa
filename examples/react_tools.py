"""A ReAct agent that tells the server about its tool calls (docs/retention.md).

Each turn the agent sends its whole conversation again (thought, action, observation, one
turn longer each time), then calls a tool: a search over a small local corpus that takes a
moment, as a real tool would. `tool("search", expected_s=...)` announces each call's start
and end, so that the server knows the agent is paused in a tool and for how long it expects
it to be: its ETA counts the rest of the call, and the server keeps its conversation in the
engine's KV cache through the call when the call is short enough for that to pay.

    python examples/react_tools.py                        # embedded server
    python examples/react_tools.py --url http://127.0.0.1:8000 --agents 4 --turns 3
"""

from __future__ import annotations

import argparse
import random

import anyio
from _runner import server_url

from justitia_sdk import AsyncClient, agent, complete, current_agent_id, tool

CORPUS = {
    "paris": "Paris is the capital of France, on the Seine.",
    "rome": "Rome is the capital of Italy, on the Tiber.",
    "seine": "The Seine flows through Paris into the English Channel.",
    "tiber": "The Tiber flows through Rome into the Tyrrhenian Sea.",
}
SEARCH_S = 0.3  # how long the search takes (and what the agent tells the server to expect)


async def search(query: str) -> str:
    """The tool: a lookup that takes a moment, as a remote search would."""
    await anyio.sleep(SEARCH_S * random.uniform(0.5, 1.5))
    hits = [text for word, text in CORPUS.items() if word in query.lower()]
    return " ".join(hits) or "no result"


@agent("react_tools", prompt=lambda question, **_: question)
async def react(question: str, turns: int = 3, max_tokens: int = 24,
                client: AsyncClient | None = None) -> dict:
    transcript = f"Question: {question}\n"
    seen: list[dict] = []
    for turn in range(turns):
        step = await complete(transcript + "Thought:", max_tokens=max_tokens, temperature=0)
        transcript += f"Thought: {step.text.strip()}\nAction: search[{question}]\n"
        async with tool("search", expected_s=SEARCH_S):
            if client is not None:  # what the server sees while the agent waits on its tool
                record = await client.get_agent(current_agent_id() or "")
                seen.append({"turn": turn, "state": record.state, "tool": record.tool,
                             "pause_remaining_s": record.pause_remaining_s})
            observation = await search(question)
        transcript += f"Observation: {observation}\n"
    answer = await complete(transcript + "Answer:", max_tokens=max_tokens, temperature=0)
    return {"answer": answer.text.strip(), "seen_in_tool": seen}


async def run(url: str, questions: list[str], turns: int) -> None:
    async with AsyncClient(url) as client:
        batch = await client.submit_many(
            react, [{"question": q, "turns": turns, "client": client} for q in questions], progress=False)
    for h in batch:
        if h.error is not None:
            raise SystemExit(f"#{h.index} failed: {h.error!r}")
        for s in h.result["seen_in_tool"]:
            rest = s["pause_remaining_s"]
            print(f"#{h.index} turn {s['turn']}: {s['state']} in {s['tool']}, "
                  f"{'?' if rest is None else f'{rest:.2f} s'} expected left")
        rec = h.record
        print(f"#{h.index} {h.status} in {rec.jct_s:.2f} s" if rec is not None and rec.jct_s is not None
              else f"#{h.index} {h.status}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running Justitia server (default: JUSTITIA_URL, else an embedded one)")
    parser.add_argument("--agents", type=int, default=4, help="agents to run at once")
    parser.add_argument("--turns", type=int, default=3, help="tool calls per agent")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="embedded server KV tokens")
    args = parser.parse_args()
    questions = ["Which river flows through Paris?", "Which river flows through Rome?"]
    with server_url(args.url, args.kv_tokens) as url:
        anyio.run(run, url, [questions[i % len(questions)] for i in range(args.agents)], args.turns)


if __name__ == "__main__":
    main()
