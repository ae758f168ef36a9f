"""What the prefill's reuse cost model decides on a real stack (docs/connector.md).

Starts a private local stack (prefill + decode, no router) with the connector's default
``reuse_cost_model: "auto"`` unless told otherwise, drives conversations leg by leg as the router
does (token-id prompts: each turn appends the reply and ``--new`` fresh tokens), and prints per
turn the prefill's reuse report with the cost model's estimates; then one turn of each
conversation sent to the decode alone ("decode continues the turn"), with the decode's own
local-hit report; then the prefill's calibrated parameters. Writes everything as JSON. Usage:

    .venv/bin/python scripts/measure_reuse_cost.py [--conversations 3] [--turns 6] \
        [--extra '{"compute_tokens_per_s": 1}'] [--json reuse-cost.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import uuid
from pathlib import Path
from typing import Any

from kvturn_server.local import Stack, StackConfig, free_port
from kvturn_server.local._direct import DirectConversation, control
from kvturn_server.local._http import post_json

PORTS = ("prefill_port", "decode_port", "prefill_side_channel_port", "decode_side_channel_port",
         "prefill_control_port", "decode_control_port")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1600) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first", type=int, default=300, help="tokens of the first prompt")
    parser.add_argument("--new", type=int, default=70, help="fresh tokens each later turn")
    parser.add_argument("--generate", type=int, default=160, help="tokens generated per turn")
    parser.add_argument("--extra", type=json.loads, default={},
                        help="JSON object merged into the prefill's kv_connector_extra_config")
    parser.add_argument("--json", type=Path, default=Path("reuse-cost.json"))
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="kvturn-reuse-cost-"))
    cfg = StackConfig(state_dir=state, model_dir=state / "model", with_router=False,
                      prefill_connector_extra=args.extra,
                      **{name: free_port() for name in PORTS})
    rows: list[dict[str, Any]] = []
    decode_rows: list[dict[str, Any]] = []
    with Stack(cfg, die_with_parent=True) as stack:
        stack.start()
        rng = random.Random(0)
        for c in range(args.conversations):
            conv = DirectConversation(cfg.prefill_url, cfg.decode_url, cfg.decode_control_url,
                                      cfg.served_model_name, key=f"measure/{uuid.uuid4().hex}")
            prompt = _tokens(rng, args.first)
            for turn in range(args.turns):
                result = conv.turn(prompt, args.generate)
                row = {"conversation": c, "turn": turn, "prompt_tokens": len(prompt),
                       **result.reuse}
                rows.append(row)
                print(json.dumps(row))  # noqa: T201
                prompt = prompt + result.token_ids + _tokens(rng, args.new)
            # The decode that holds the conversation serves the next turn alone.
            reply = post_json(f"{cfg.decode_url}/v1/completions", {
                "model": cfg.served_model_name, "prompt": prompt, "max_tokens": args.generate,
                "temperature": 0, "ignore_eos": True,
                "kv_transfer_params": {"do_remote_prefill": False,
                                       "kvturn": {"conversation": conv.key}}}, timeout=600)
            info = (reply.get("kv_transfer_params") or {}).get("kvturn", {})
            decode_row = {"conversation": c, "prompt_tokens": len(prompt),
                          "retained": info.get("retained"), **info.get("reuse", {})}
            decode_rows.append(decode_row)
            print(json.dumps({"decode_alone": decode_row}))  # noqa: T201
            conv.release()
        status, stats = control(cfg.prefill_control_url, "GET", "/kvturn/v1/stats")
    model = stats.get("cost_model") if status == 200 else None
    print(json.dumps({"cost_model": model}, indent=1))  # noqa: T201
    args.json.write_text(json.dumps({
        "config": {"model_size": cfg.model_size, "prefill_connector_extra": args.extra,
                   "conversations": args.conversations, "turns": args.turns,
                   "first": args.first, "new": args.new, "generate": args.generate},
        "turns": rows, "decode_alone": decode_rows, "cost_model": model}, indent=1))
    print(f"wrote {args.json}")  # noqa: T201


if __name__ == "__main__":
    main()
