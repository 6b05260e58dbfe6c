"""A ShareGPT-style prompts file: what quickstart's step 2 would fetch."""

import json


def write_prompts(path, n=8):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                                             {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
