"""A stand-alone prefixkv worker for router tests and drills: a real manager, its events on ZMQ.

    python -m prefixkv.fleet.worker --worker-id w0 --num-blocks 256 --block-size 4

Prints one JSON line with its endpoints and incarnation, then reads JSON commands on
stdin, one per line, answering each with a JSON line once its events are handed to the
publisher: ``{"op": "admit", "id": "r1", "tokens": [...]}``, ``{"op": "free", "id": "r1"}``,
``{"op": "reset"}``, ``{"op": "drop_next"}`` (the next batch is lost on the wire: fault
injection). A bad command is answered ``{"error": "..."}`` and the worker goes on. End of
input stops it.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..manager import KVCacheManager
from .publisher import KVEventPublisher


COMMANDS_HELP = """\
commands on stdin, one JSON object per line:
  {"op": "admit", "id": "r1", "tokens": [1, 2, 3, ...]}   admit a request (id: a string or number)
  {"op": "free", "id": "r1"}                               free it (its full blocks stay cached)
  {"op": "reset"}                                          forget every cached block
  {"op": "drop_next"}                                      lose the next batch on the wire
each answered on stdout with {"ok": OP} once its events are handed to the publisher,
or {"error": "..."} naming what is wrong (the worker goes on); end of input stops it.
The first line printed gives the endpoints: {"worker_id", "incarnation", "endpoints"}.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixkv.fleet.worker",
                                description="A stand-alone prefixkv worker: a real KVCacheManager whose KV "
                                            "events go out on ZMQ, driven by JSON commands on stdin.",
                                epilog=COMMANDS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--hash-seed", type=int, default=0)
    p.add_argument("--fingerprint", default="")
    p.add_argument("--heartbeat-interval", type=float, default=0.1)
    for name in ("endpoint", "replay-endpoint", "heartbeat-endpoint"):
        p.add_argument(f"--{name}", default="tcp://127.0.0.1:0")
    args = p.parse_args(argv)
    mgr = KVCacheManager(args.num_blocks, args.block_size, hash_seed=args.hash_seed, record_events=True)
    pub = KVEventPublisher(args.worker_id, manager=mgr, endpoint=args.endpoint,
                           replay_endpoint=args.replay_endpoint, heartbeat_endpoint=args.heartbeat_endpoint,
                           fingerprint=args.fingerprint, heartbeat_interval_s=args.heartbeat_interval)
    pub.set_load(free_blocks=mgr.num_free_blocks)
    print(json.dumps({"worker_id": args.worker_id, "incarnation": pub.incarnation, "endpoints": pub.endpoints}),
          flush=True)
    drop = False
    try:
        for line in sys.stdin:
            try:
                op, cmd = _command(line)
                prompts = []
                if op == "admit":
                    prompt = mgr.prompt(cmd["tokens"])
                    mgr.admit(cmd["id"], prompt)
                    prompts.append(prompt)
                elif op == "free":
                    mgr.free(cmd["id"])
                elif op == "reset":
                    mgr.reset_prefix_cache(preempt_running=True)
                elif op == "drop_next":
                    drop = True
                if op != "drop_next":
                    pub.publish_from(mgr, prompts=prompts, drop=drop)
                    drop = False
            except Exception as exc:   # a bad command is answered, and the worker goes on
                print(json.dumps({"error": _describe(exc)}), flush=True)
                continue
            pub.set_load(free_blocks=mgr.num_free_blocks, running_requests=len(mgr))
            print(json.dumps({"ok": op}), flush=True)
    finally:
        pub.close()
    return 0


OPS = ("admit", "free", "reset", "drop_next")
FIELDS = {"admit": ("id", "tokens"), "free": ("id",), "reset": (), "drop_next": ()}


def _command(line: str) -> tuple[str, dict]:
    try:
        cmd = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"command is not JSON ({exc}): {line.strip()[:80]!r}") from None
    if not isinstance(cmd, dict):
        raise ValueError(f"a command is a JSON object, got {type(cmd).__name__}")
    op = cmd.get("op")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    missing = [name for name in FIELDS[op] if name not in cmd]
    if missing:
        raise ValueError(f"op {op!r} needs {', '.join(map(repr, missing))}")
    return op, cmd


def _describe(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"

if __name__ == "__main__":
    sys.exit(main())
