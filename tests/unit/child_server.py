"""A tiny real HTTP server that plays the child in lifecycle unit tests (not llama-server's API).

It accepts the arguments the wrapper adds (`--host`, `--port`) plus switches that script a behaviour:
  --load-delay S    answer /health 503 for S seconds, then 200
  --ignore-term     ignore SIGTERM (the wrapper must SIGKILL it)
  --term-delay S    on SIGTERM, exit 0 after S seconds
  --die-after S     exit on its own after S seconds, with --exit-code N (or --die-signal SIG)
  --record FILE     append one line per request to FILE ("METHOD PATH")
  --fail-start      exit 1 at once
  --slot-save-path DIR   where POST /slots/N?action=save writes (an empty slot's file, as a state-version probe)
  --die-on-restore  abort (SIGABRT) on POST /slots/N?action=restore, as llama-server does on some damaged files
Endpoints: /health, /echo (method, path, query, headers, body), /stream?n=N&delay=S[&gate=1] (SSE; with gate
the events after the first wait for a GET /release), /props and /slots (one slot of 4096 cells), slot actions,
anything else 200 (with ?hold, once a GET /release came).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--load-delay", type=float, default=0.0)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--term-delay", type=float, default=0.0)
    parser.add_argument("--die-after", type=float)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--die-signal")
    parser.add_argument("--record")
    parser.add_argument("--fail-start", action="store_true")
    parser.add_argument("-m", "--model")
    parser.add_argument("--slot-save-path")
    parser.add_argument("--die-on-restore", action="store_true")
    options, _ = parser.parse_known_args()
    if options.fail_start:
        print("child: failing at start", flush=True)
        sys.exit(1)
    ready_at = time.monotonic() + options.load_delay
    released = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            url = urlsplit(self.path)
            if options.record:
                with open(options.record, "a") as out:
                    out.write(f"{self.command} {url.path}\n")
            if url.path == "/health":
                if time.monotonic() < ready_at:
                    self._send(503, {"error": {"code": 503, "message": "Loading model"}})
                else:
                    self._send(200, {"status": "ok"})
            elif url.path == "/echo":
                self._send(200, {"method": self.command, "path": url.path, "query": url.query,
                                 "headers": dict(self.headers.items()), "body": body.decode()})
            elif url.path == "/props":
                self._send(200, {"total_slots": 1, "default_generation_settings": {"n_ctx": 4096},
                                 "build_info": "b0-child"})
            elif url.path == "/tokenize":  # one token per byte: enough for the conversation cache to choose
                self._send(200, {"tokens": list(json.loads(body or b"{}").get("content", "").encode())})
            elif url.path == "/slots" and self.command == "GET":
                self._send(200, [{"id": 0, "n_ctx": 4096, "is_processing": False}])
            elif url.path.startswith("/slots/") and "action=restore" in url.query and options.die_on_restore:
                print("child: aborting in a restore", flush=True)
                os.kill(os.getpid(), signal.SIGABRT)
            elif url.path.startswith("/slots/") and "action=save" in url.query and options.slot_save_path:
                name = json.loads(body or b"{}").get("filename", "slot.bin")
                empty = struct.pack("<IIIiIII", 0x67677371, 4, 4, -1, 1, 0, 0) + struct.pack("<I", 1) + b"\0" * 4
                with open(os.path.join(options.slot_save_path, name), "wb") as out:
                    out.write(empty)
                self._send(200, {"id_slot": 0, "filename": name, "n_saved": 0, "n_written": len(empty)})
            elif url.path == "/release":
                released.set()
                self._send(200, {"released": True})
            elif url.path == "/stream":
                query = parse_qs(url.query)
                count, delay = int(query.get("n", ["5"])[0]), float(query.get("delay", ["0"])[0])
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for index in range(count):
                    event = f"data: {json.dumps({'index': index})}\n\n".encode()
                    self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                    self.wfile.flush()
                    if index == 0 and "gate" in query:
                        released.wait(30)  # hold the rest until /release: proves the proxy did not buffer
                    time.sleep(delay)
                self.wfile.write(b"0\r\n\r\n")
            else:
                if "hold" in parse_qs(url.query):
                    released.wait(30)  # answered after a GET /release: a request that keeps its slot
                self._send(200, {"path": url.path, "headers": dict(self.headers.items()), "body": body.decode()})

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: object, client_address: object) -> None:
            pass  # a client that hangs up (the wrapper closing keep-alive connections) is not news

    server = Server((options.host, options.port), Handler)

    def on_term(signum: int, frame: object) -> None:
        print("child: got SIGTERM", flush=True)
        if options.ignore_term:
            return
        def finish() -> None:
            time.sleep(options.term_delay)
            print("child: exiting after SIGTERM", flush=True)
            os._exit(0)
        threading.Thread(target=finish, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    if options.die_after is not None:
        def die() -> None:
            time.sleep(options.die_after)
            print("child: dying on its own", flush=True)
            if options.die_signal:
                os.kill(os.getpid(), getattr(signal, options.die_signal))
                time.sleep(5)  # the signal may reach another thread a moment later
            os._exit(options.exit_code)
        threading.Thread(target=die, daemon=True).start()
    print(f"child: listening on {options.host}:{options.port} pid {os.getpid()}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
