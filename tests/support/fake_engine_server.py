"""A scripted stand-in for an SGLang/vLLM server process (neither is installed on CI machines).

Started by the launcher through `--engine-command "python fake_engine_server.py --fake-mode MODE ..."`; it
receives the engine's real argv after that prefix. Modes:
  ready   -- answers health checks with 200 and reports its argv (parsed into settings, as SGLang does, with a
             random seed drawn at each boot unless --random-seed is given) and environment as its server info;
  503     -- listens but answers 503 forever (a server that never becomes ready), with a child process
             of its own to prove the launcher kills the whole group;
  exit    -- prints a message and exits with code 3 before listening.
`--fake-info-json JSON` merges extra fields into the server info (e.g. a lossy threshold).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fake-mode", default="ready")
    parser.add_argument("--fake-pidfile")
    parser.add_argument("--fake-info-json", default="{}")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, engine_args = parser.parse_known_args()
    print(f"fake engine starting in mode {args.fake_mode} with {engine_args}", flush=True)
    if args.fake_mode == "exit":
        print("fake engine: fatal: cannot load model weights", flush=True)
        sys.exit(3)
    if args.fake_pidfile:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(args.fake_pidfile, "w") as f:
            json.dump({"server": os.getpid(), "child": child.pid}, f)
    # Like SGLang's /get_server_info: the server arguments at top level, a random seed drawn per boot unless given.
    server_args = {"random_seed": random.randint(0, 1 << 30)}
    i = 0
    while i < len(engine_args):
        if engine_args[i].startswith("--"):
            takes_value = i + 1 < len(engine_args) and not engine_args[i + 1].startswith("--")
            server_args[engine_args[i][2:].replace("-", "_")] = engine_args[i + 1] if takes_value else True
            i += 1 + takes_value
        else:
            i += 1
    info = {
        **server_args,
        "version": "0.0-fake",
        # as SGLang 0.5.23 reports them: the command line as given, and when this boot started
        "launch_command": shlex.join([sys.argv[0], *engine_args, "--port", str(args.port)]),
        "startup_time": time.time(),
        "environ": {k: v for k, v in os.environ.items() if k.startswith(("SGLANG_", "VLLM_", "FAKE_"))},
        "port": args.port,
        **json.loads(args.fake_info_json),
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):
            print("fake engine: " + fmt % a, flush=True)

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if args.fake_mode == "503":
                print("fake engine: still warming up", flush=True)
                return self._send(503, {"error": "warming up"})
            if self.path in ("/health", "/health_generate"):
                return self._send(200, {})
            if self.path in ("/get_server_info", "/server_info"):
                return self._send(200, info)
            if self.path == "/version":
                return self._send(200, {"version": "0.0-fake"})
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            return self._send(404, {"error": "not found"})

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
